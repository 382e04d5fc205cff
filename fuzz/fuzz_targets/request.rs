//! `decode_body::<Request>`: a control frame's body as the daemon decodes it from any local
//! user.
//!
//! Properties (`control_body.rs`): whatever decodes encodes again, that encoding decodes to an
//! equal request (one whose own encoding is the same bytes: floats may be NaN), and
//! `encode_frame` frames exactly that body behind its length.
#![no_main]

include!("control_body.rs");

control_body_target!(agora_protocol::control::Request);
