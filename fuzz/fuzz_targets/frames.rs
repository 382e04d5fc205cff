//! Control-frame reassembly: the daemon's `FrameReader` reading a non-blocking Unix socket,
//! fed the input in chunks (sizes drawn from the input's first byte) as a client could send it,
//! then closed. Every frame body it returns is decoded as a `Request`, as the daemon does.
//!
//! Properties: the frames returned, in order, are exactly those a reference parse of the whole
//! byte stream finds (`u32` little-endian length, then the body); an oversize header ends the
//! stream in `Err(Protocol)` (the frames before it that came in the same read are dropped with
//! the connection: a prefix of them is returned); a partial frame is kept across reads and
//! never returned; once the peer has closed and the frames are drained, the reader says
//! `Closed`.
#![no_main]

use std::io::Write;
use std::os::unix::net::UnixStream;

use agora_protocol::control::{decode_body, Request, MAX_FRAME};
use agora_transport::socket::FrameReader;
use agora_transport::TransportError;
use libfuzzer_sys::fuzz_target;

/// Complete frames of `stream`, and whether an oversize header ends them.
fn reference(stream: &[u8]) -> (Vec<&[u8]>, bool) {
    let mut frames = Vec::new();
    let mut at = 0;
    while stream.len() - at >= 4 {
        let len = u32::from_le_bytes(stream[at..at + 4].try_into().unwrap());
        if len > MAX_FRAME {
            return (frames, true);
        }
        let end = at + 4 + len as usize;
        if end > stream.len() {
            break;
        }
        frames.push(&stream[at + 4..end]);
        at = end;
    }
    (frames, false)
}

fuzz_target!(|data: &[u8]| {
    let Some((&seed, stream)) = data.split_first() else {
        return;
    };
    let (expected, oversize) = reference(stream);
    let (client, daemon) = UnixStream::pair().expect("socketpair");
    daemon.set_nonblocking(true).expect("non-blocking");
    let mut reader = FrameReader::default();
    let mut got: Vec<Vec<u8>> = Vec::new();
    let mut failed = false;
    let mut state = u32::from(seed) | 0x100;
    let mut at = 0;
    while at < stream.len() && !failed {
        state = state.wrapping_mul(1_103_515_245).wrapping_add(12_345);
        let size = ((state >> 16) as usize % 64 + 1).min(stream.len() - at);
        (&client).write_all(&stream[at..at + size]).expect("write");
        at += size;
        match reader.read_frames(&daemon) {
            Ok(frames) => got.extend(frames),
            Err(TransportError::Protocol(_)) => failed = true,
            Err(e) => panic!("unexpected error while the peer is open: {e}"),
        }
    }
    drop(client);
    if !failed {
        loop {
            match reader.read_frames(&daemon) {
                Ok(frames) => {
                    assert!(!frames.is_empty(), "a closed peer gave Ok(nothing)");
                    got.extend(frames);
                }
                Err(TransportError::Closed) => break,
                Err(TransportError::Protocol(_)) => {
                    failed = true;
                    break;
                }
                Err(e) => panic!("unexpected error after close: {e}"),
            }
        }
    }
    assert_eq!(failed, oversize, "oversize header not reported (or reported wrongly)");
    // On an oversize header the daemon drops the connection: frames that arrived in the same
    // read as the bad header are not returned, so only a prefix of the good ones is promised.
    if oversize {
        assert!(got.len() <= expected.len(), "frame count");
    } else {
        assert_eq!(got.len(), expected.len(), "frame count");
    }
    for (g, e) in got.iter().zip(&expected) {
        assert_eq!(g.as_slice(), *e);
        let _ = decode_body::<Request>(g);
    }
});
