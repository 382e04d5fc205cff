//! Quick start: one saxpy on whatever device the daemon picks.
//!
//! Start a daemon (`agora serve`), then: `cargo run --release -p agora --example quickstart`.
//! The function between the README markers is the README's client example, verbatim; a test
//! checks that they stay identical and runs it against a real daemon.

fn main() -> Result<(), agora::Error> {
    let session = agora::Session::connect()?;
    quickstart(&session)?;
    println!("saxpy verified");
    Ok(())
}

// README example begins
use agora::{Arg, Session};

/// Computes y <- 3x + y on a million elements and checks the result.
pub fn quickstart(session: &Session) -> Result<(), agora::Error> {
    let queue = session.queue("quickstart")?;
    let saxpy = session.kernel("saxpy")?; // y <- a*x + y, checked against its signature
    let n = 1 << 20;
    let x = session.buffer_from(&vec![1.0f32; n])?; // host copies live in shared memory
    let y = session.buffer_from(&vec![2.0f32; n])?;
    queue.sync_to(&x)?;
    queue.sync_to(&y)?;
    queue.launch(&saxpy, &[Arg::F32(3.0), (&x).into(), (&y).into()], n)?;
    queue.sync_from(&y)?;
    queue.finish()?; // waits for the queue; fails if any of its tasks failed
    assert!(y.as_slice::<f32>().iter().all(|v| *v == 5.0));
    Ok(())
}
// README example ends
