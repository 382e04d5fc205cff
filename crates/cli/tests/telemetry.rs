//! Metrics and traces of a known workload, with a real daemon process.

use std::process::Command;

use agora::{Arg, DeviceKind, QueueOptions, Session, SessionOptions};
use agora_test_support::{free_port, scrape_metrics as scrape, Daemon};

const AGORA: &str = env!("CARGO_BIN_EXE_agora");

#[test]
fn metrics_and_trace_count_a_known_workload() {
    let port = free_port();
    let mut daemon = Daemon::start(
        AGORA,
        "telemetry",
        &["--metrics", &port.to_string(), "--trace", "{dir}/trace.json"],
    );
    let dir = daemon.dir().to_path_buf();
    let socket = daemon.socket().to_path_buf();
    let trace = dir.join("trace.json");

    // The known workload: 10 saxpy launches on the CPU, 7 on OpenCL (each after a sync_to).
    let session = Session::connect_with(SessionOptions {
        socket: Some(socket.clone()),
        name: Some("tenant-t".into()),
        heap_bytes: None,
        control_timeout: None,
        reconnect_timeout: None,
    })
    .unwrap();
    let saxpy = session.kernel("saxpy").unwrap();
    let n = 1 << 20;
    let x = session.buffer_from(&vec![1.0f32; n]).unwrap();
    let y = session.buffer_from(&vec![0.0f32; n]).unwrap();
    for (kind, launches) in [(DeviceKind::Cpu, 10), (DeviceKind::OpenCl, 7)] {
        let q = session
            .queue_with(QueueOptions {
                name: format!("{kind:?}"),
                preferred_device: Some(kind),
                sla: None,
                ..Default::default()
            })
            .unwrap();
        q.sync_to(&x).unwrap();
        for _ in 0..launches {
            q.launch(&saxpy, &[Arg::F32(1.0), (&x).into(), (&y).into()], n).unwrap();
        }
        q.sync_from(&y).unwrap();
        q.finish().unwrap();
    }
    assert!(y.as_slice::<f32>().iter().all(|v| *v == 17.0));

    // Metrics: parse with a Prometheus parser; the counts match.
    let text = scrape(port);
    let lines = text.lines().map(|l| Ok(l.to_string()));
    let scrape = prometheus_parse::Scrape::parse(lines).expect("the exposition parses");
    let sum = |name: &str, label: (&str, &str)| -> f64 {
        scrape
            .samples
            .iter()
            .filter(|s| s.metric == name && s.labels.get(label.0) == Some(label.1))
            .map(|s| match s.value {
                prometheus_parse::Value::Counter(v)
                | prometheus_parse::Value::Gauge(v)
                | prometheus_parse::Value::Untyped(v) => v,
                _ => 0.0,
            })
            .sum()
    };
    assert_eq!(sum("agora_tasks_total", ("kernel", "saxpy")), 17.0, "{text}");
    assert_eq!(sum("agora_tasks_total", ("kernel", "sync_to")), 2.0);
    assert_eq!(sum("agora_tasks_total", ("outcome", "error")), 0.0);
    // The OpenCL queue moved x and y to the device and y back: at least 8 MiB in, 4 MiB out.
    assert!(sum("agora_transferred_bytes_total", ("direction", "host_to_device")) >= (8 << 20) as f64);
    assert!(sum("agora_transferred_bytes_total", ("direction", "device_to_host")) >= (4 << 20) as f64);
    assert!(text.contains("agora_lane_busy_seconds{"), "lane gauges are present");
    assert!(scrape
        .samples
        .iter()
        .any(|s| s.metric == "agora_sessions" && matches!(s.value, prometheus_parse::Value::Gauge(v) if v == 1.0)));

    // Trace: saved on request; one exec span per launch, on the lane rows of the right devices.
    let out = Command::new(AGORA)
        .args(["trace", "save", "--socket"])
        .arg(&socket)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let doc: serde_json::Value = serde_json::from_slice(&std::fs::read(&trace).unwrap()).unwrap();
    let events = doc["traceEvents"].as_array().unwrap();
    let rows: std::collections::HashMap<u64, String> = events
        .iter()
        .filter(|e| e["ph"] == "M" && e["name"] == "thread_name")
        .map(|e| {
            (
                e["tid"].as_u64().unwrap(),
                e["args"]["name"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    let exec_on = |prefix: &str| {
        events
            .iter()
            .filter(|e| e["ph"] == "X" && e["cat"] == "exec" && e["name"] == "saxpy")
            .filter(|e| rows[&e["tid"].as_u64().unwrap()].starts_with(prefix))
            .count()
    };
    assert_eq!(exec_on("cpu0/"), 10);
    assert_eq!(exec_on("opencl0/"), 7);
    assert!(events
        .iter()
        .all(|e| e["ph"] != "X" || e["args"]["tenant"] == "tenant-t"));
    assert!(
        events.iter().any(|e| e["cat"] == "transfer"),
        "the OpenCL sync_to moved data"
    );
    assert!(events
        .iter()
        .filter(|e| e["ph"] == "X")
        .all(|e| e["dur"].as_f64().unwrap() >= 0.0));

    // The timeline picture: one exec bar per exec span, the tenant in the legend; a PNG too.
    let svg = dir.join("timeline.svg");
    let out = Command::new(AGORA)
        .args(["plot", "trace"])
        .arg(&trace)
        .arg("-o")
        .arg(&svg)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let picture = std::fs::read_to_string(&svg).unwrap();
    let exec_spans = events.iter().filter(|e| e["ph"] == "X" && e["cat"] == "exec").count();
    assert_eq!(picture.matches(r#"class="exec""#).count(), exec_spans);
    assert!(picture.contains("tenant-t"));
    let png = dir.join("timeline.png");
    let out = Command::new(AGORA)
        .args(["plot", "trace"])
        .arg(&trace)
        .arg("-o")
        .arg(&png)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(std::fs::read(&png).unwrap().starts_with(b"\x89PNG\r\n\x1a\n"));
    // Bad input is a clear error.
    let out = Command::new(AGORA)
        .args(["plot", "trace"])
        .arg(&socket)
        .arg("-o")
        .arg(&svg)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let out = Command::new(AGORA)
        .args(["plot", "trace"])
        .arg(&trace)
        .arg("-o")
        .arg(dir.join("x.gif"))
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&out.stderr).contains(".svg or .png"));

    drop((x, y, session));
    daemon.stop();
}

#[test]
fn top_once_json_shows_two_live_tenants() {
    let daemon = Daemon::start(AGORA, "top", &["--no-opencl"]);
    let socket = daemon.socket().to_path_buf();
    let open = |name: &str| {
        Session::connect_with(SessionOptions {
            socket: Some(socket.clone()),
            name: Some(name.into()),
            heap_bytes: None,
            control_timeout: None,
            reconnect_timeout: None,
        })
        .unwrap()
    };
    let a = open("tenant-a");
    let b = open("tenant-b");
    let _qa = a.queue_with(QueueOptions {
        name: "fast".into(),
        class: agora::QueueClass::Latency,
        ..Default::default()
    });
    let _qb1 = b.queue("one").unwrap();
    let _qb2 = b.queue("two").unwrap();
    let out = Command::new(AGORA)
        .args(["top", "--once", "--json", "--socket"])
        .arg(&socket)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let view: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let tenants = view["tenants"].as_array().unwrap();
    let find = |name: &str| {
        tenants
            .iter()
            .find(|t| t["name"] == name)
            .unwrap_or_else(|| panic!("{name} in {view}"))
    };
    assert_eq!(find("tenant-a")["queues"].as_array().unwrap().len(), 1);
    assert_eq!(find("tenant-a")["classes"], serde_json::json!(["latency"]));
    assert_eq!(find("tenant-b")["queues"].as_array().unwrap().len(), 2);
    assert_eq!(find("tenant-b")["pid"], std::process::id());
    assert_eq!(view["policy"], "perf");
    // The dispatcher's stalls are there for an operator to see (how many is the machine's
    // business, not this test's).
    assert!(
        view["dispatcher_stalls"].is_u64() && view["recent_stalls"].is_u64(),
        "{view}"
    );
    assert!(
        view["dispatcher_longest_ms"].as_f64().is_some_and(|ms| ms > 0.0),
        "{view}"
    );
    // What batch lanes run at now (the default `auto`: `idle` while latency work is live, else
    // `batch`, which is also what an unprivileged daemon gets).
    assert!(matches!(view["batch_lanes"].as_str(), Some("idle" | "batch")), "{view}");
    // Without --once and without a terminal: a clear refusal, not a garbled screen.
    let out = Command::new(AGORA)
        .args(["top", "--socket"])
        .arg(&socket)
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--once"));
    // A refresh interval that is no usable number of seconds is refused, naming the range (NaN
    // made the refresh loop panic).
    for interval in ["nan", "0", "0.01", "1e9"] {
        let out = Command::new(AGORA)
            .args(["top", "--interval", interval, "--socket"])
            .arg(&socket)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "--interval {interval}: {stderr}");
        assert!(
            stderr.contains("between 0.1 and 60 seconds"),
            "--interval {interval}: {stderr}"
        );
    }
    drop((a, b));
}
