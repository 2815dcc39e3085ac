//! The worker's listening socket, closed so that no connection the kernel accepted is reset.
//!
//! Closing a listening TCP socket resets every connection still in its accept queue: those
//! clients completed the handshake and sent their request, then read "connection reset" — and a
//! client cannot tell whether a reset request ran. Under steady traffic (a load balancer that has
//! not yet seen the readiness flip, or the autoscaler's own race with an idle exit) some always
//! are in the queue. So when the worker exits, [`ClosingListener`]:
//!
//! 1. attaches a socket filter that drops new handshakes' SYNs (Linux classic BPF,
//!    unprivileged) and waits a moment for handshakes under way: the queue can then only
//!    shrink — the dropped clients' SYN retransmits find the port closed a second later and
//!    read "connection refused", which says plainly that nothing ran;
//! 2. takes every connection already queued (non-blocking `accept` until it would block) and
//!    hands each to the server like any other — it gets a whole response, 503 when draining;
//! 3. closes the socket, then counts the open connections down ([`Conns`]) so the caller can
//!    start hyper's graceful shutdown (which closes idle connections at once) only after the
//!    connections it just took were answered.
//!
//! Where the filter cannot be attached, step 2 still takes the queue; only connections that
//! arrive between the last `accept` and the close can then be reset.

use std::collections::VecDeque;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, Notify};

/// How long the listener waits, after it stops taking new handshakes, for those under way (the
/// client's last ACK is a round trip away: microseconds here, a millisecond across a zone).
const HANDSHAKE_SETTLE: Duration = Duration::from_millis(20);

/// Open connections, counted down as each closes.
#[derive(Default)]
pub struct Conns {
    open: AtomicUsize,
    closed_one: Notify,
    /// True once the listening socket is closed.
    listener_closed: watch::Sender<bool>,
}

impl Conns {
    pub fn open(&self) -> usize {
        self.open.load(Ordering::SeqCst)
    }

    /// Waits until the listener is closed and then until no connection is open, or `limit`
    /// passes after the close (a client holding an idle keep-alive connection must not hold the
    /// exit).
    pub async fn closed_and_quiet(&self, limit: Duration) {
        let _ = self.listener_closed.subscribe().wait_for(|c| *c).await;
        let quiet = async {
            loop {
                let notified = self.closed_one.notified();
                if self.open() == 0 {
                    return;
                }
                notified.await;
            }
        };
        if tokio::time::timeout(limit, quiet).await.is_err() {
            super::log(format_args!(
                "{} connection(s) still open {limit:?} after the port closed are closed now",
                self.open()
            ));
        }
    }
}

/// A TCP listener that, once `exit` turns true, takes its queue and closes (module docs).
pub struct ClosingListener {
    listener: Option<TcpListener>,
    /// Connections taken from the queue at exit (counted open already), handed out one per
    /// `accept`.
    taken: VecDeque<(Counted, SocketAddr)>,
    exit: watch::Receiver<bool>,
    conns: Arc<Conns>,
    addr: SocketAddr,
}

impl ClosingListener {
    pub fn new(listener: TcpListener, exit: watch::Receiver<bool>) -> io::Result<ClosingListener> {
        let addr = listener.local_addr()?;
        Ok(ClosingListener {
            listener: Some(listener),
            taken: VecDeque::new(),
            exit,
            conns: Arc::default(),
            addr,
        })
    }

    pub fn conns(&self) -> Arc<Conns> {
        self.conns.clone()
    }

    fn counted(&self, (stream, addr): (TcpStream, SocketAddr)) -> (Counted, SocketAddr) {
        self.conns.open.fetch_add(1, Ordering::SeqCst);
        let conns = self.conns.clone();
        (Counted { stream, conns }, addr)
    }

    /// Steps 1–3 of the module docs, except the count: stop handshakes, take the queue, close.
    async fn take_queue_and_close(&mut self) {
        let Some(listener) = self.listener.take() else {
            return;
        };
        match drop_new_handshakes(&listener) {
            // Handshakes under way finish within a round trip; then the queue holds them too.
            Ok(()) => tokio::time::sleep(HANDSHAKE_SETTLE).await,
            Err(e) => super::log(format_args!(
                "closing the listener without a socket filter ({e}): connections arriving \
                 while it closes may be reset"
            )),
        }
        match listener.into_std() {
            Ok(std_listener) => loop {
                match std_listener.accept() {
                    Ok((s, a)) => match s
                        .set_nonblocking(true)
                        .and_then(|()| TcpStream::from_std(s))
                    {
                        Ok(s) => {
                            let c = self.counted((s, a));
                            self.taken.push_back(c);
                        }
                        Err(e) => super::log(format_args!("a queued connection is lost: {e}")),
                    },
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                    // ECONNABORTED concerns one connection; EMFILE (below) would repeat.
                    Err(e)
                        if matches!(
                            e.kind(),
                            io::ErrorKind::Interrupted | io::ErrorKind::ConnectionAborted
                        ) =>
                    {
                        continue
                    }
                    Err(e) => {
                        super::log(format_args!("taking the accept queue at exit: {e}"));
                        break;
                    }
                }
            },
            Err(e) => super::log(format_args!("taking the accept queue at exit: {e}")),
        }
        if !self.taken.is_empty() {
            super::log(format_args!(
                "answering {} connection(s) queued at exit, then closing the port",
                self.taken.len()
            ));
        }
        // The std listener was dropped at the end of the match: the port is closed.
        self.conns.listener_closed.send_replace(true);
    }
}

impl axum::serve::Listener for ClosingListener {
    type Io = Counted;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Counted, SocketAddr) {
        loop {
            if let Some(c) = self.taken.pop_front() {
                return c;
            }
            let Some(listener) = &self.listener else {
                // Closed: axum stops calling once the graceful shutdown starts.
                std::future::pending::<()>().await;
                continue;
            };
            let exiting = *self.exit.borrow();
            if exiting {
                self.take_queue_and_close().await;
                continue;
            }
            let mut exit = self.exit.clone();
            tokio::select! {
                r = listener.accept() => match r {
                    Ok(c) => return self.counted(c),
                    Err(e) => accept_error(e).await,
                },
                _ = async { exit.wait_for(|e| *e).await.map(|_| ()) } => {}
            }
        }
    }

    fn local_addr(&self) -> io::Result<SocketAddr> {
        Ok(self.addr)
    }
}

/// What axum's own listener does: errors about one connection are skipped; running out of file
/// descriptors waits a moment instead of spinning.
async fn accept_error(e: io::Error) {
    let per_connection = matches!(
        e.kind(),
        io::ErrorKind::ConnectionRefused
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::ConnectionReset
            | io::ErrorKind::Interrupted
    );
    if !per_connection {
        super::log(format_args!("accept: {e}"));
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Attaches a classic BPF program to the listening socket that drops SYN segments (new
/// handshakes) and passes the rest, so handshakes already under way still complete.
///
/// A TCP socket filter sees the segment from its TCP header on: byte 13 holds the flags.
fn drop_new_handshakes(listener: &TcpListener) -> io::Result<()> {
    #[cfg(target_os = "linux")]
    {
        use std::os::fd::AsRawFd;
        const TCP_FLAGS: u32 = 13;
        const ACK: u32 = 0x10;
        const SYN: u32 = 0x02;
        let insn = |code: u32, jt: u8, jf: u8, k: u32| libc::sock_filter {
            code: code as u16,
            jt,
            jf,
            k,
        };
        let mut program = [
            insn(libc::BPF_LD | libc::BPF_B | libc::BPF_ABS, 0, 0, TCP_FLAGS),
            // ACK set (a handshake's last step, or data): pass.
            insn(libc::BPF_JMP | libc::BPF_JSET | libc::BPF_K, 2, 0, ACK),
            // SYN without ACK: a new handshake, drop; anything else: pass.
            insn(libc::BPF_JMP | libc::BPF_JSET | libc::BPF_K, 0, 1, SYN),
            insn(libc::BPF_RET | libc::BPF_K, 0, 0, 0),
            insn(libc::BPF_RET | libc::BPF_K, 0, 0, u32::MAX),
        ];
        let prog = libc::sock_fprog {
            len: program.len() as u16,
            filter: program.as_mut_ptr(),
        };
        // SAFETY: setsockopt on a socket we own; `prog` and the instructions it points to live
        // across the call, and the kernel copies (and verifies) the program.
        let rc = unsafe {
            libc::setsockopt(
                listener.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_ATTACH_FILTER,
                (&prog as *const libc::sock_fprog).cast(),
                std::mem::size_of::<libc::sock_fprog>() as libc::socklen_t,
            )
        };
        if rc == 0 {
            Ok(())
        } else {
            Err(io::Error::last_os_error())
        }
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = listener;
        Err(io::Error::new(io::ErrorKind::Unsupported, "not Linux"))
    }
}

/// A connection that counts itself out of [`Conns`] when dropped.
pub struct Counted {
    stream: TcpStream,
    conns: Arc<Conns>,
}

impl Drop for Counted {
    fn drop(&mut self) {
        self.conns.open.fetch_sub(1, Ordering::SeqCst);
        self.conns.closed_one.notify_waiters();
    }
}

impl AsyncRead for Counted {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_read(cx, buf)
    }
}

impl AsyncWrite for Counted {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::serve::Listener;
    use std::io::{Read, Write};
    use tokio::io::AsyncReadExt;

    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn the_filter_stops_new_handshakes_and_spares_open_connections() {
        runtime().block_on(async {
            let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
            let addr = l.local_addr().unwrap();
            let mut before = std::net::TcpStream::connect(addr).unwrap();
            let (mut server_side, _) = l.accept().await.unwrap();
            drop_new_handshakes(&l).unwrap();
            // A new handshake gets no answer (its SYN is dropped), so it cannot complete.
            let late = tokio::task::spawn_blocking(move || {
                std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(300))
            });
            let err = late
                .await
                .unwrap()
                .expect_err("a handshake completed past the filter");
            assert_eq!(err.kind(), io::ErrorKind::TimedOut, "{err}");
            // The connection made before still carries data both ways.
            before.write_all(b"ping").unwrap();
            let mut got = [0u8; 4];
            server_side.read_exact(&mut got).await.unwrap();
            assert_eq!(&got, b"ping");
            tokio::io::AsyncWriteExt::write_all(&mut server_side, b"pong")
                .await
                .unwrap();
            before.read_exact(&mut got).unwrap();
            assert_eq!(&got, b"pong");
        });
    }

    #[test]
    fn at_exit_the_queue_is_handed_out_then_the_port_refuses() {
        runtime().block_on(async {
            let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
            let addr = l.local_addr().unwrap();
            let (exit_tx, exit_rx) = watch::channel(false);
            let mut listener = ClosingListener::new(l, exit_rx).unwrap();
            let conns = listener.conns();
            // Five clients complete their handshake and send a request nobody accepted yet.
            let mut clients: Vec<_> = (0..5u8)
                .map(|i| {
                    let mut c = std::net::TcpStream::connect(addr).unwrap();
                    c.write_all(&[b'0' + i]).unwrap();
                    c
                })
                .collect();
            exit_tx.send_replace(true);
            let mut served = Vec::new();
            for _ in 0..5 {
                let (mut io, _) = tokio::time::timeout(Duration::from_secs(5), listener.accept())
                    .await
                    .expect("a queued connection is handed out");
                let mut b = [0u8; 1];
                io.read_exact(&mut b).await.unwrap();
                tokio::io::AsyncWriteExt::write_all(&mut io, &b)
                    .await
                    .unwrap();
                served.push(b[0]);
                drop(io);
            }
            served.sort();
            assert_eq!(served, b"01234");
            // Every client got its answer back, none a reset.
            for (i, c) in clients.iter_mut().enumerate() {
                let mut echo = Vec::new();
                c.read_to_end(&mut echo).unwrap();
                assert_eq!(echo, [b'0' + i as u8]);
            }
            // The port is closed, the sixth is refused, and the count is back to zero.
            let e = std::net::TcpStream::connect(addr).expect_err("the port is closed");
            assert_eq!(e.kind(), io::ErrorKind::ConnectionRefused);
            assert_eq!(conns.open(), 0);
            tokio::time::timeout(
                Duration::from_secs(1),
                conns.closed_and_quiet(Duration::from_secs(5)),
            )
            .await
            .expect("closed and quiet at once");
            // Nothing more is handed out.
            assert!(
                tokio::time::timeout(Duration::from_millis(100), listener.accept())
                    .await
                    .is_err()
            );
        });
    }
}
