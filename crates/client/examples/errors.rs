//! What failures look like: every mistake comes back as a typed error that names the problem.
//!
//! Start a daemon (`agora serve`), then: `cargo run --release -p agora --example errors`.

use agora::{Arg, Error, Session};

fn main() -> Result<(), Error> {
    let session = Session::connect()?;
    let queue = session.queue("errors")?;

    // An unknown kernel name is refused at lookup, with suggestions.
    match session.kernel("saxp") {
        Err(e) => println!("lookup:    {e}"),
        Ok(_) => unreachable!("no kernel is called saxp"),
    }

    let saxpy = session.kernel("saxpy")?;
    let x = session.buffer(16 * 4)?;
    let y = session.buffer(16 * 4)?;

    // Wrong argument count, wrong type, too small for the range: the task fails, nothing else.
    let attempts: [(&str, Vec<Arg<'_>>, u64); 3] = [
        ("count", vec![Arg::F32(1.0), (&x).into()], 16),
        ("type", vec![Arg::F32(1.0), Arg::F32(2.0), (&y).into()], 16),
        ("size", vec![Arg::F32(1.0), (&x).into(), (&y).into()], 1000),
    ];
    for (what, args, n) in attempts {
        match queue.launch(&saxpy, &args, n)?.wait() {
            Err(Error::Task(e)) => println!("{what:<10} {e}   [kind: {}]", e.kind()),
            other => println!("{what:<10} unexpected: {other:?}"),
        }
    }

    // A buffer allocation beyond the session quota is an error, not a crash.
    match session.buffer(1 << 50) {
        Err(e) => println!("quota:     {e}"),
        Ok(_) => println!("quota:     (the daemon granted a petabyte?)"),
    }

    // finish() reports every task of the queue that failed since the previous finish(),
    // whether or not its own wait() reported it already.
    let _ = queue.launch(&saxpy, &[Arg::F32(1.0), (&x).into(), (&x).into()], 16)?;
    match queue.finish() {
        Err(Error::Tasks(failures)) => {
            println!("finish:    {} task(s) failed", failures.count);
            for (task, error) in &failures.failures {
                println!("           task {task}: {error}");
            }
        }
        other => println!("finish:    unexpected: {other:?}"),
    }
    Ok(())
}
