//! `decode_body::<Response>`: a control frame's body as the clients (Rust, and C and Python
//! through it) decode it from the daemon.
//!
//! Properties: whatever decodes encodes again, that encoding decodes to an equal response (one
//! whose own encoding is the same bytes: floats may be NaN), and `encode_frame` frames exactly
//! that body behind its length.
#![no_main]

use agora_protocol::control::{decode_body, encode_frame, Response};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(message) = decode_body::<Response>(data) else {
        return;
    };
    let body = postcard::to_stdvec(&message).expect("a decoded response encodes");
    assert!(
        body.len() <= data.len(),
        "re-encoding grew: {} > {}",
        body.len(),
        data.len()
    );
    let again: Response = decode_body(&body).expect("an encoded response decodes");
    if message == message {
        assert_eq!(again, message);
    }
    assert_eq!(postcard::to_stdvec(&again).unwrap(), body);
    let frame = encode_frame(&message).unwrap();
    assert_eq!(&frame[4..], &body[..]);
    assert_eq!(u32::from_le_bytes(frame[..4].try_into().unwrap()) as usize, body.len());
});
