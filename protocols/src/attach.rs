//! How the VMM gets a device: `--device NAME[@TRANSPORT[:WHERE]]` or
//! `--device TRANSPORT:PATH`. TRANSPORT is a name in
//! [`TRANSPORTS`](crate::TRANSPORTS), and what it carries
//! ([`Transport::carries`]) is checked as the spec is parsed.
//!
//! Over a function transport (vfio-user, mpqemu, ioregionfd):
//! - `pci-testdev`: the model in the VMM (exits and KVM ioeventfds).
//! - `pci-testdev@TRANSPORT`: the model in a device process the VMM starts
//!   (`iopath serve`, over a socketpair); its counters come back when the
//!   run ends.
//! - `...@TRANSPORT:PATH`: connect to a device process already serving on
//!   the UNIX socket PATH (`iopath serve ... --socket PATH`).
//! - `pci-testdev@mpqemu:qemu`: QEMU's own model, in `qemu-system-x86_64
//!   -machine x-remote` started by the VMM (interoperability), for a
//!   transport QEMU speaks.
//! - `vfio-user:PATH` (any function transport's name): whatever device the
//!   server on the UNIX socket PATH serves, iopath's or not (libvfio-user's
//!   samples, SPDK's NVMe target, QEMU's x-vfio-user-server, a rust-vmm
//!   `vfio_user::Server`): the proxy takes its identity, BARs and
//!   capabilities from the server.
//!
//! Over a queue transport (vhost-user), the function in the VMM:
//! - `virtio-blk[,OPTS]@vhost-user`: a virtio-blk function of the VMM's
//!   transport whose queues iopath's backend (`iopath serve
//!   virtio-blk,OPTS --transport vhost-user --fd 3`) serves, started by the
//!   VMM on a socketpair (see [`vhost_user::frontend`](crate::vhost_user::frontend)).
//! - `virtio-blk[,queues=N]@vhost-user:PATH`: the same with whatever backend
//!   listens on PATH (iopath's, qemu-storage-daemon's, any); of OPTS only
//!   `queues=N` counts there. `vhost-user-blk:PATH` (the transport's
//!   [`any_backend`](crate::QueueTransport::any_backend) name) is that with
//!   one queue. The function has the `queues=N` of OPTS.
//!
//! virtio-blk's queues without `queues=N` ([`queues_of`]): one per vCPU of
//! the VMM ([`VCPUS`]), whether the function is in the VMM, in a device
//! process the VMM starts (which is told `queues=N` in its argv) or a
//! queue transport's frontend. A device process started on its own does
//! not know its client's vCPUs and offers
//! [`MAX_QUEUES`](iopath_devices::virtio::transport::MAX_QUEUES)
//! (`serve`), of which Linux's virtio_blk takes one per CPU.

use crate::process::{DeviceProcess, CHILD_SOCKET_FD};
use crate::transport::{transport, Transport};
use crate::vfio_user::ProxyConfig;
use crate::{Error, Result};
use iopath_devices::{DeviceConfig, SharedDevice};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::str::FromStr;

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Endpoint {
    /// The VMM starts `iopath serve` on a socketpair.
    Spawn,
    /// A device process listening on this UNIX socket.
    Socket(PathBuf),
    /// QEMU `-machine x-remote` started by the VMM.
    Qemu,
}

/// What a spec attaches.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Device {
    /// One of iopath's models: in the VMM, served by `iopath serve` or QEMU
    /// (a function transport), or served by iopath's backend (a queue
    /// transport, [`Endpoint::Spawn`]).
    Model(DeviceConfig),
    /// Whatever the server on the socket serves (`TRANSPORT:PATH`, with
    /// `remote` a function transport's [`Endpoint::Socket`]): its identity,
    /// BARs and capabilities come from the server.
    Server,
    /// The function a queue transport's frontend makes in the VMM, with this
    /// many queues, which whatever backend listens on the socket serves
    /// (`remote` a queue transport's [`Endpoint::Socket`]).
    Frontend { queues: u16 },
}

/// A device and where it runs: `CONFIG[@TRANSPORT[:PATH|:qemu]]` or
/// `TRANSPORT:PATH`, parsed and validated once (the device options
/// included) before anything starts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceSpec {
    pub device: Device,
    pub remote: Option<(Transport, Endpoint)>,
}

impl DeviceSpec {
    /// Whatever device the server on the UNIX socket `path` serves over the
    /// function transport `transport`.
    pub fn server(transport: &'static dyn crate::FunctionTransport, path: impl Into<PathBuf>) -> Self {
        DeviceSpec {
            device: Device::Server,
            remote: Some((Transport::Function(transport), Endpoint::Socket(path.into()))),
        }
    }

    /// `model` over `t` at `ep`, checked as a spec's text is: `t` carries
    /// the model, QEMU speaks `t` for [`Endpoint::Qemu`], a socket has a
    /// path. Over a queue transport on a socket the model is the function's
    /// queue count only (the backend there has its own disk).
    pub fn remote(model: DeviceConfig, t: Transport, ep: Endpoint) -> Result<Self> {
        t.carries(&model)?;
        match &ep {
            Endpoint::Qemu if !t.qemu_speaks() => {
                return Err(Error::Config(format!("QEMU's x-remote does not speak {}", t.name())))
            }
            Endpoint::Socket(p) if p.as_os_str().is_empty() => {
                return Err(Error::Config(format!("{model}@{t}: the socket path is missing")))
            }
            _ => {}
        }
        let device = match (t, &ep) {
            (Transport::Queues(_), Endpoint::Socket(_)) => Device::Frontend { queues: queues_of(&model) },
            _ => Device::Model(model),
        };
        Ok(DeviceSpec { device, remote: Some((t, ep)) })
    }

    /// `TRANSPORT:PATH` or a queue transport's `ANY_BACKEND:PATH`, if `s` is
    /// one: no device name comes first (no device name is a transport
    /// name), and the path is taken as it is.
    fn parse_server(s: &str) -> Result<Option<Self>> {
        let after = |name: &str| s.strip_prefix(name).and_then(|r| r.strip_prefix(':'));
        for &t in crate::TRANSPORTS {
            let (path, device) = match t {
                Transport::Function(_) => match after(t.name()) {
                    Some(p) => (p, Device::Server),
                    None => continue,
                },
                Transport::Queues(q) => match (after(q.any_backend()), after(q.name())) {
                    (Some(p), _) => (p, Device::Frontend { queues: 1 }),
                    (None, Some(_)) => {
                        return Err(Error::Config(format!(
                            "{s:?}: a {} backend serves the queues of a function the VMM makes: \
                             name it ({}:PATH, {}[,queues=N]@{}:PATH)",
                            q.name(),
                            q.any_backend(),
                            q.device(),
                            q.name()
                        )))
                    }
                    (None, None) => continue,
                },
            };
            if path.is_empty() {
                return Err(Error::Config(format!("{s:?}: the socket path of the {} server is missing", t.name())));
            }
            return Ok(Some(DeviceSpec { device, remote: Some((t, Endpoint::Socket(path.into()))) }));
        }
        Ok(None)
    }
}

/// The vCPUs of iopath's VMM (`iopath_vmm` makes vCPU 0 only).
pub const VCPUS: u16 = 1;

/// The queues a model's function has in this VMM: `queues=N`, else one per
/// vCPU ([`VCPUS`]); 1 for a device without queues of its own to count.
pub fn queues_of(model: &DeviceConfig) -> u16 {
    match model {
        DeviceConfig::VirtioBlk(c) => c.queues.unwrap_or(VCPUS),
        _ => 1,
    }
}

impl FromStr for DeviceSpec {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        if let Some(spec) = Self::parse_server(s)? {
            return Ok(spec);
        }
        let (device, rest) = match iopath_devices::spec::find_unescaped_at(s) {
            Some(i) => (&s[..i], Some(&s[i + 1..])),
            None => (s, None),
        };
        let model: DeviceConfig = device.parse()?;
        let Some(r) = rest else { return Ok(DeviceSpec { device: Device::Model(model), remote: None }) };
        let (t, place) = match r.split_once(':') {
            Some((t, p)) => (t, Some(p)),
            None => (r, None),
        };
        let ep = match place {
            None => Endpoint::Spawn,
            Some("qemu") => Endpoint::Qemu,
            Some(p) => Endpoint::Socket(PathBuf::from(p)),
        };
        Self::remote(model, transport(t)?, ep)
    }
}

impl std::fmt::Display for DeviceSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let model = match (&self.device, &self.remote) {
            (Device::Model(m), _) => m,
            (Device::Server, Some((t, Endpoint::Socket(p)))) => return write!(f, "{t}:{}", p.display()),
            (Device::Frontend { queues: 1 }, Some((Transport::Queues(q), Endpoint::Socket(p)))) => {
                return write!(f, "{}:{}", q.any_backend(), p.display())
            }
            (Device::Frontend { queues }, Some((Transport::Queues(q), Endpoint::Socket(p)))) => {
                return write!(f, "{},queues={queues}@{}:{}", q.device(), q.name(), p.display())
            }
            // Not specs FromStr makes (instantiate refuses them).
            (Device::Server | Device::Frontend { .. }, Some((t, _))) => return write!(f, "{t}:?"),
            (Device::Server | Device::Frontend { .. }, None) => return f.write_str("server:?"),
        };
        write!(f, "{model}")?;
        match &self.remote {
            None => Ok(()),
            Some((t, Endpoint::Spawn)) => write!(f, "@{t}"),
            Some((t, Endpoint::Qemu)) => write!(f, "@{t}:qemu"),
            Some((t, Endpoint::Socket(p))) => write!(f, "@{t}:{}", p.display()),
        }
    }
}

/// Where the programs a device spec may start live.
#[derive(Clone, Debug)]
pub struct Programs {
    /// The iopath binary (for `iopath serve`).
    pub iopath: PathBuf,
    /// qemu-system-x86_64, for `@TRANSPORT:qemu`.
    pub qemu: Option<PathBuf>,
    /// More `iopath serve` arguments (e.g. `--spin-us N`).
    pub serve_args: Vec<String>,
}

impl Programs {
    /// This executable as the device-process binary.
    pub fn current(qemu: Option<PathBuf>) -> Result<Self> {
        let iopath = std::env::current_exe().map_err(|e| Error::io("cannot find the iopath binary", e))?;
        Ok(Programs { iopath, qemu, serve_args: Vec::new() })
    }
}

/// QEMU's name for an iopath device model, where QEMU has one.
fn qemu_device(device: &DeviceConfig) -> Result<&'static str> {
    match device {
        DeviceConfig::PciTestDev => Ok("pci-testdev"),
        d => Err(Error::Config(format!("QEMU has no model of {}", d.name()))),
    }
}

fn socketpair() -> Result<(UnixStream, UnixStream)> {
    UnixStream::pair().map_err(|e| Error::io("socketpair", e))
}

/// Starts (or connects to) what the spec names and returns the model the
/// VMM hosts: the device itself, its function transport's proxy for it, or
/// its queue transport's frontend.
pub fn instantiate(spec: &DeviceSpec, progs: &Programs) -> Result<SharedDevice> {
    instantiate_with(spec, progs, &ProxyConfig::default())
}

/// [`instantiate`] with a function transport's proxy configured as `cfg`
/// says (`iopath run --state-memory`).
pub fn instantiate_with(spec: &DeviceSpec, progs: &Programs, cfg: &ProxyConfig) -> Result<SharedDevice> {
    let label = spec.to_string();
    let (model, transport, ep) = match (&spec.device, &spec.remote) {
        (Device::Model(m), None) => return Ok(m.with_default_queues(VCPUS).build()?),
        (Device::Model(m), Some((t, ep))) => (m, *t, ep),
        (Device::Server, Some((Transport::Function(t), Endpoint::Socket(path)))) => {
            let sock = connect_to(path, &label)?;
            return t.connect_with(sock, None, &label, cfg).map_err(|e| e.context(label));
        }
        (Device::Frontend { queues }, Some((Transport::Queues(q), Endpoint::Socket(path)))) => {
            let sock = connect_to(path, &label)?;
            let again = crate::respawn::Reconnect::socket(path);
            return q.connect_again(sock, None, *queues, again).map_err(|e| e.context(label));
        }
        (Device::Server, _) => {
            return Err(Error::Config(format!("{spec}: a server's device needs the server's socket (TRANSPORT:PATH)")))
        }
        (Device::Frontend { .. }, _) => {
            return Err(Error::Config(format!("{spec}: a frontend needs its backend's socket (a queue transport's)")))
        }
    };
    match transport {
        Transport::Function(t) => function(model, t, ep, progs, cfg),
        Transport::Queues(q) => {
            // iopath's backend started by the VMM (a socket is a Frontend).
            let (mine, child) = spawn_serve(progs, model, q.name()).map_err(|e| e.context(label.clone()))?;
            let args = crate::respawn::serve_args(progs, &model.with_default_queues(queues_of(model)), q.name());
            let again = crate::respawn::Reconnect::Respawn { exe: progs.iopath.clone(), args };
            q.connect_again(mine, Some(child), queues_of(model), Some(again)).map_err(|e| e.context(label))
        }
    }
}

/// `model` in a device process over the function transport `t`: started by
/// the VMM (iopath's or QEMU's) or listening on a socket.
fn function(
    model: &DeviceConfig,
    t: &'static dyn crate::FunctionTransport,
    ep: &Endpoint,
    progs: &Programs,
    cfg: &ProxyConfig,
) -> Result<SharedDevice> {
    let label = format!("{model}@{}", t.name());
    let (sock, child) = match ep {
        Endpoint::Spawn => {
            let (mine, child) = spawn_serve(progs, model, t.name())?;
            (mine, Some(child))
        }
        Endpoint::Socket(path) => (connect_to(path, &label)?, None),
        Endpoint::Qemu => {
            let qemu = progs
                .qemu
                .as_deref()
                .ok_or_else(|| Error::Config(format!("QEMU is needed for @{}:qemu but was not found", t.name())))?;
            let (mine, theirs) = socketpair()?;
            let child = DeviceProcess::spawn_qemu(qemu_remote(qemu, qemu_device(model)?), theirs.into(), QEMU_START)?;
            (mine, Some(child))
        }
    };
    t.connect_with(sock, child, model.name(), cfg).map_err(|e| e.context(label))
}

/// [`connect`] with the error a spec reports (`label`: the spec).
fn connect_to(path: &Path, label: &str) -> Result<UnixStream> {
    connect(path).map_err(|e| Error::io(format!("{label}: cannot connect to {}", path.display()), e))
}

/// `iopath serve MODEL --transport TRANSPORT --fd N` (and the programs'
/// serve arguments) on a new socket pair: our end and the device process.
/// MODEL has its queue count written out ([`queues_of`]): the process,
/// which cannot know this VMM's vCPUs, would otherwise offer its own default.
/// A backing file is checked (and with `create=on` made) here first, so
/// that a missing one is one error, not a device process that dies.
fn spawn_serve(progs: &Programs, model: &DeviceConfig, transport: &str) -> Result<(UnixStream, DeviceProcess)> {
    model.prepare_backing()?;
    let (mine, theirs) = socketpair()?;
    let model = model.with_default_queues(queues_of(model));
    let args = crate::respawn::serve_args(progs, &model, transport);
    let child = DeviceProcess::spawn(&progs.iopath, &args, theirs.into())?;
    Ok((mine, child))
}

/// How long connecting to a server's socket may take: a listener whose
/// backlog is full (it never accepts) makes a blocking connect wait.
pub const CONNECT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// Connects to the Unix socket at `path` within [`CONNECT_TIMEOUT`]
/// (SO_SNDTIMEO bounds connect(2) on a Unix socket; past it, EAGAIN, which
/// is `WouldBlock`, which [`Error::io`] makes a timeout). The socket's own
/// timeouts are left unset, as `UnixStream::connect` leaves them.
pub(crate) fn connect(path: &Path) -> std::io::Result<UnixStream> {
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
    use std::os::unix::ffi::OsStrExt;
    // SAFETY: sockaddr_un is plain data; all-zero is a valid value.
    let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    let bytes = path.as_os_str().as_bytes();
    if bytes.len() >= addr.sun_path.len() {
        return Err(std::io::Error::new(std::io::ErrorKind::InvalidInput, "socket path too long"));
    }
    addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
    for (d, &b) in addr.sun_path.iter_mut().zip(bytes) {
        *d = b as libc::c_char;
    }
    // SAFETY: socket(2) with constant arguments; the fd is owned at once.
    let fd = unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: fd was just created and is owned here only.
    let sock = UnixStream::from(unsafe { OwnedFd::from_raw_fd(fd) });
    sock.set_write_timeout(Some(CONNECT_TIMEOUT))?;
    let len = (std::mem::size_of::<libc::sa_family_t>() + bytes.len() + 1) as libc::socklen_t;
    // SAFETY: addr is a valid sockaddr_un, len within it.
    if unsafe { libc::connect(sock.as_raw_fd(), (&raw const addr).cast(), len) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    sock.set_write_timeout(None)?;
    Ok(sock)
}

/// How long QEMU's `-machine x-remote` may take to start running.
const QEMU_START: std::time::Duration = std::time::Duration::from_secs(30);

/// `qemu-system-x86_64 -machine x-remote` hosting QEMU's `device` on fd 3,
/// with QMP on its standard input and output (to wait for it to run).
pub fn qemu_remote(qemu: &Path, device: &str) -> std::process::Command {
    let mut c = std::process::Command::new(qemu);
    c.args(["-machine", "x-remote", "-nodefaults", "-display", "none", "-monitor", "none", "-serial", "none"]);
    c.args(["-qmp", "stdio"]);
    c.args(["-device", &format!("{device},id=dev0")]);
    c.args(["-object", &format!("x-remote-object,id=robj0,devid=dev0,fd={CHILD_SOCKET_FD}")]);
    c
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_specs_parse() {
        let t = |name| transport(name).unwrap();
        let s: DeviceSpec = "pci-testdev".parse().unwrap();
        assert_eq!(s.remote, None);
        let s: DeviceSpec = "pci-testdev@vfio-user:/tmp/x.sock".parse().unwrap();
        assert_eq!(s.remote, Some((t("vfio-user"), Endpoint::Socket("/tmp/x.sock".into()))));
        let s: DeviceSpec = "pci-testdev@mpqemu:qemu".parse().unwrap();
        assert_eq!(s.remote, Some((t("mpqemu"), Endpoint::Qemu)));
        let s: DeviceSpec = "pci-testdev@ioregionfd-posted".parse().unwrap();
        assert_eq!(s.remote, Some((t("ioregionfd-posted"), Endpoint::Spawn)));
        assert!("nvme9".parse::<DeviceSpec>().is_err());
        assert!("pci-testdev@carrier-pigeon".parse::<DeviceSpec>().is_err());
        assert!("pci-testdev@vfio-user:qemu".parse::<DeviceSpec>().is_err());
        assert!("pci-testdev@vfio-user:".parse::<DeviceSpec>().is_err(), "a socket path is missing");
        let e = "nvme,doorbell=shmm@vfio-user".parse::<DeviceSpec>().unwrap_err().to_string();
        assert!(e.contains("doorbell"), "a bad option is named before anything starts: {e}");
        for s in [
            "nvme,doorbell=bar,backend=file:/a,,b@@c,size_mb=64,lba=512@vfio-user:/tmp/s",
            "pci-testdev@mpqemu:qemu",
            "vfio-user:/run/spdk/cntrl",
            "vfio-user:/tmp/a,b@c.sock",
        ] {
            assert_eq!(s.parse::<DeviceSpec>().unwrap().to_string(), s);
        }
    }

    #[test]
    fn vhost_user_specs_parse() {
        let vu = transport("vhost-user").unwrap();
        let socket = |p: &str| Some((vu, Endpoint::Socket(p.into())));
        let s: DeviceSpec = "vhost-user-blk:/tmp/vu.sock".parse().unwrap();
        assert_eq!(s, DeviceSpec { device: Device::Frontend { queues: 1 }, remote: socket("/tmp/vu.sock") });
        let s: DeviceSpec = "virtio-blk,backend=null,size_mb=8@vhost-user".parse().unwrap();
        assert_eq!(s.remote, Some((vu, Endpoint::Spawn)));
        let Device::Model(m) = &s.device else { panic!("{s:?}") };
        assert_eq!(m.to_string(), "virtio-blk,backend=null,size_mb=8,notify=exit");
        let s: DeviceSpec = "virtio-blk@vhost-user:/tmp/a,b@c".parse().unwrap();
        assert_eq!((s.device, s.remote), (Device::Frontend { queues: 1 }, socket("/tmp/a,b@c")), "a path as it is");
        // queues=N is the function's, on a socket too (the other options are the backend's own).
        let s: DeviceSpec = "virtio-blk,backend=null,queues=4@vhost-user:/tmp/vu.sock".parse().unwrap();
        assert_eq!((s.device, s.remote), (Device::Frontend { queues: 4 }, socket("/tmp/vu.sock")));
        let s: DeviceSpec = "virtio-blk,queues=1@vhost-user:/tmp/vu.sock".parse().unwrap();
        assert_eq!(s.to_string(), "vhost-user-blk:/tmp/vu.sock");
        for s in [
            "vhost-user-blk:/tmp/vu.sock",
            "vhost-user-blk:/tmp/a,b@c",
            "virtio-blk,backend=ram,size_mb=64,notify=poll@vhost-user",
            "virtio-blk,backend=ram,size_mb=64,notify=poll,queues=2@vhost-user",
            "virtio-blk,queues=3@vhost-user:/tmp/a,b@c",
        ] {
            assert_eq!(s.parse::<DeviceSpec>().unwrap().to_string(), s);
        }
        for bad in [
            "vhost-user-blk:",
            "vhost-user:/tmp/vu.sock",
            "virtio-blk@vhost-user:",
            "virtio-blk@vhost-user:qemu",
            "virtio-blk,notify=never@vhost-user",
            "virtio-blk,queues=17@vhost-user",
            "virtio-blk,queues=0@vhost-user:/tmp/s",
        ] {
            assert!(bad.parse::<DeviceSpec>().is_err(), "{bad}");
        }
        // A device the transport does not carry: a typed error that says what it carries.
        for (bad, device) in [("nvme@vhost-user", "nvme"), ("pci-testdev@vhost-user:/tmp/s", "pci-testdev")] {
            let e = bad.parse::<DeviceSpec>().unwrap_err();
            assert!(matches!(&e, Error::Carry { transport: "vhost-user", device: d, .. } if d == device), "{e:?}");
            assert!(e.to_string().contains("virtio-blk@vhost-user"), "{e}");
        }
        // The spawn path needs the program; nobody listens on the socket path.
        let progs = Programs { iopath: "/nonexistent".into(), qemu: None, serve_args: Vec::new() };
        let e = instantiate(&"virtio-blk@vhost-user".parse().unwrap(), &progs).err().unwrap().to_string();
        assert!(e.contains("virtio-blk") && e.contains("/nonexistent"), "{e}");
        let e = instantiate(&"vhost-user-blk:/nonexistent/vu.sock".parse().unwrap(), &progs).err().unwrap().to_string();
        assert!(e.contains("vhost-user-blk:/nonexistent/vu.sock"), "{e}");
        // Typed specs are checked as text ones are.
        let nvme: DeviceConfig = "nvme".parse().unwrap();
        assert!(matches!(DeviceSpec::remote(nvme, vu, Endpoint::Spawn), Err(Error::Carry { .. })));
    }

    #[test]
    fn a_function_of_this_vmm_has_a_queue_per_vcpu_unless_told() {
        let m = |s: &str| s.parse::<DeviceConfig>().unwrap();
        assert_eq!(queues_of(&m("virtio-blk,backend=null")), VCPUS);
        assert_eq!(queues_of(&m("virtio-blk,queues=4")), 4);
        assert_eq!(queues_of(&m("nvme")), 1);
        // A device process the VMM starts is told the count (it would offer 16 by itself).
        let spawned = m("virtio-blk,backend=null").with_default_queues(queues_of(&m("virtio-blk,backend=null")));
        assert!(spawned.to_string().ends_with(&format!(",queues={VCPUS}")), "{spawned}");
    }

    #[test]
    fn an_external_server_is_whatever_device_it_serves() {
        let s: DeviceSpec = "vfio-user:/run/vfio-user.sock".parse().unwrap();
        let vfio_user = transport("vfio-user").unwrap();
        assert_eq!(s.device, Device::Server);
        assert_eq!(s.remote, Some((vfio_user, Endpoint::Socket("/run/vfio-user.sock".into()))));
        // The path is taken as it is: `,` and `@` are not escapes there.
        let s: DeviceSpec = "vfio-user:/tmp/a,b@c".parse().unwrap();
        assert_eq!(s.remote, Some((vfio_user, Endpoint::Socket("/tmp/a,b@c".into()))));
        for bad in ["vfio-user:", "vfio-user", "carrier-pigeon:/tmp/x"] {
            assert!(bad.parse::<DeviceSpec>().is_err(), "{bad}");
        }
        let e = instantiate(
            &DeviceSpec { device: Device::Server, remote: None },
            &Programs { iopath: "/nonexistent".into(), qemu: None, serve_args: Vec::new() },
        );
        assert!(matches!(e, Err(Error::Config(_))), "a server spec needs a socket");
        let e = instantiate(&s, &Programs { iopath: "/nonexistent".into(), qemu: None, serve_args: Vec::new() });
        assert!(e.is_err_and(|e| e.to_string().contains("/tmp/a,b@c")), "nobody listens there");
    }

    #[test]
    fn connecting_to_a_listener_that_never_accepts_is_bounded() {
        // A listener with a backlog of 0 whose one slot is taken: a connect waits for room.
        let dir = std::env::temp_dir().join(format!("iopath-attach-backlog-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("full.sock");
        let l = std::os::unix::net::UnixListener::bind(&path).unwrap();
        // SAFETY: listen(2) again on a listening socket only changes its backlog.
        assert_eq!(unsafe { libc::listen(std::os::fd::AsRawFd::as_raw_fd(&l), 0) }, 0);
        let _first = UnixStream::connect(&path).unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        for spec in [format!("vhost-user-blk:{}", path.display()), format!("vfio-user:{}", path.display())] {
            let (tx, spec) = (tx.clone(), spec.parse::<DeviceSpec>().unwrap());
            std::thread::spawn(move || {
                let progs = Programs { iopath: "/nonexistent".into(), qemu: None, serve_args: Vec::new() };
                let _ = tx.send(instantiate(&spec, &progs).map(drop).map_err(|e| e.to_string()));
            });
        }
        for _ in 0..2 {
            let r = rx.recv_timeout(std::time::Duration::from_secs(30)).expect("connect still waiting after 30 s");
            assert!(r.as_ref().is_err_and(|e| e.contains("timed out")), "{r:?}");
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}
