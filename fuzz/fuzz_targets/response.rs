//! `decode_body::<Response>`: a control frame's body as the clients (Rust, and C and Python
//! through it) decode it from the daemon.
//!
//! Properties (`control_body.rs`): whatever decodes encodes again, that encoding decodes to an
//! equal response (one whose own encoding is the same bytes: floats may be NaN), and
//! `encode_frame` frames exactly that body behind its length.
#![no_main]

include!("control_body.rs");

control_body_target!(agora_protocol::control::Response);
