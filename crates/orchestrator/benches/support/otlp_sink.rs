//! A minimal OTLP/HTTP receiver for the benchmarks that trace their calls: it answers
//! 200 to every export, keeps nothing, and counts the requests and bytes it got. Shared
//! by the gate bench and the e2e bench's `observe` rows.

use std::io::{BufRead as _, BufReader, Read as _, Write as _};
use std::net::{TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

pub struct OtlpSink {
    /// `http://<address>`: the value of `OTEL_EXPORTER_OTLP_ENDPOINT`.
    pub url: String,
    requests: Arc<AtomicU64>,
    bytes: Arc<AtomicU64>,
}

impl OtlpSink {
    /// Listens on a free loopback port, one thread per connection.
    pub fn start() -> std::io::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0")?;
        let url = format!("http://{}", listener.local_addr()?);
        let requests = Arc::new(AtomicU64::new(0));
        let bytes = Arc::new(AtomicU64::new(0));
        let (r, b) = (requests.clone(), bytes.clone());
        std::thread::spawn(move || {
            for stream in listener.incoming().flatten() {
                let (r, b) = (r.clone(), b.clone());
                std::thread::spawn(move || {
                    let _ = serve(stream, &r, &b);
                });
            }
        });
        Ok(Self {
            url,
            requests,
            bytes,
        })
    }

    /// Export requests received so far.
    #[allow(dead_code)]
    pub fn requests(&self) -> u64 {
        self.requests.load(Ordering::Relaxed)
    }

    /// Body bytes received so far.
    #[allow(dead_code)]
    pub fn bytes(&self) -> u64 {
        self.bytes.load(Ordering::Relaxed)
    }
}

/// HTTP/1.1 requests on one connection, until the client closes it.
fn serve(stream: TcpStream, requests: &AtomicU64, bytes: &AtomicU64) -> std::io::Result<()> {
    let mut writer = stream.try_clone()?;
    let mut reader = BufReader::new(stream);
    let mut line = String::new();
    loop {
        line.clear();
        if reader.read_line(&mut line)? == 0 {
            return Ok(());
        }
        let mut length = 0u64;
        loop {
            line.clear();
            reader.read_line(&mut line)?;
            let header = line.trim_end();
            if header.is_empty() {
                break;
            }
            if let Some((name, value)) = header.split_once(':')
                && name.eq_ignore_ascii_case("content-length")
            {
                length = value.trim().parse().unwrap_or(0);
            }
        }
        let read = std::io::copy(&mut (&mut reader).take(length), &mut std::io::sink())?;
        requests.fetch_add(1, Ordering::Relaxed);
        bytes.fetch_add(read, Ordering::Relaxed);
        writer.write_all(
            b"HTTP/1.1 200 OK\r\ncontent-type: application/x-protobuf\r\ncontent-length: 0\r\n\r\n",
        )?;
    }
}
