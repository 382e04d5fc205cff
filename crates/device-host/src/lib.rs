//! Device hosts: each OpenCL platform runs in a child process of the daemon (DESIGN.md §3,
//! "device hosts"; the design of Chromium's GPU process), so a driver that asserts, segfaults or
//! hangs ends that process, not the daemon and every tenant's work with it.
//!
//! * [`remote`] — the daemon's side: [`RemoteDevice`], a [`Device`](agora_devices::Device)
//!   whose lanes forward their jobs to the host; failure detection, restart, segment sharing;
//! * [`host`] — the host's side (`agora device-host`): the real OpenCL devices, serving the
//!   daemon's requests;
//! * [`wire`] — the messages between them.
//!
//! Must not: know about sessions, queues or scheduling (the daemon's lanes and scheduler stay
//! the same for a device in a host); load OpenCL in the daemon (the platform list comes from the
//! host program too).

pub mod host;
pub mod remote;
pub mod wire;

pub use host::{list_platforms as print_platforms, serve, HostArgs};
pub use remote::{list_platforms, start_platform, HostSpec, RemoteDevice};
