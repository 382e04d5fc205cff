// The property shared by the `request` and `response` targets (included by both, so each stays a
// single binary of its own): whatever `decode_body` decodes encodes again, that encoding decodes
// to an equal message (one whose own encoding is the same bytes: floats may be NaN), and
// `encode_frame` frames exactly that body behind its length.
macro_rules! control_body_target {
    ($message:ty) => {
        libfuzzer_sys::fuzz_target!(|data: &[u8]| {
            use agora_protocol::control::{decode_body, encode_frame};
            let Ok(message) = decode_body::<$message>(data) else {
                return;
            };
            let body = postcard::to_stdvec(&message).expect("a decoded message encodes");
            assert!(
                body.len() <= data.len(),
                "re-encoding grew: {} > {}",
                body.len(),
                data.len()
            );
            let again: $message = decode_body(&body).expect("an encoded message decodes");
            #[allow(clippy::eq_op)] // false only for a message holding a NaN
            if message == message {
                assert_eq!(again, message);
            }
            assert_eq!(postcard::to_stdvec(&again).unwrap(), body);
            let frame = encode_frame(&message).unwrap();
            assert_eq!(&frame[4..], &body[..]);
            assert_eq!(u32::from_le_bytes(frame[..4].try_into().unwrap()) as usize, body.len());
        });
    };
}
