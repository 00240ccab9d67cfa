//! A raw NBD client for tests that need the protocol's steps one by one
//! (bad input, handshakes by the thousand).

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

pub const IHAVEOPT: u64 = 0x4948_4156_454f_5054;
pub const REQUEST_MAGIC: u32 = 0x2560_9513;

/// A raw NBD client: each step of the handshake and transmission by hand.
pub struct Raw {
    pub stream: TcpStream,
}

impl Raw {
    pub fn connect(address: &str) -> Raw {
        Raw::greeted(TcpStream::connect(address).unwrap())
    }

    /// Connects from `source` (another loopback address: another client
    /// to the server).
    pub fn connect_from(address: &str, source: std::net::IpAddr) -> Raw {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_io()
            .build()
            .unwrap();
        let stream = runtime.block_on(async {
            let socket = tokio::net::TcpSocket::new_v4().unwrap();
            socket.bind((source, 0).into()).unwrap();
            let stream = socket.connect(address.parse().unwrap()).await.unwrap();
            stream.into_std().unwrap()
        });
        stream.set_nonblocking(false).unwrap();
        Raw::greeted(stream)
    }

    fn greeted(mut stream: TcpStream) -> Raw {
        stream.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut greeting = [0u8; 18];
        stream.read_exact(&mut greeting).unwrap();
        assert_eq!(&greeting[0..8], b"NBDMAGIC");
        assert_eq!(u64::from_be_bytes(greeting[8..16].try_into().unwrap()), IHAVEOPT);
        Raw { stream }
    }

    /// Connects and sends the fixed-newstyle, no-zeroes client flags.
    pub fn start(address: &str) -> Raw {
        let mut raw = Raw::connect(address);
        raw.send(&3u32.to_be_bytes());
        raw
    }

    /// NBD_OPT_GO on `name` from `source`, simple replies.
    pub fn go_from(address: &str, name: &str, source: std::net::IpAddr) -> Raw {
        let mut raw = Raw::connect_from(address, source);
        raw.send(&3u32.to_be_bytes());
        raw.finish_go(name);
        raw
    }

    pub fn send(&mut self, bytes: &[u8]) {
        self.stream.write_all(bytes).unwrap();
    }

    pub fn read(&mut self, count: usize) -> Vec<u8> {
        let mut bytes = vec![0u8; count];
        self.stream.read_exact(&mut bytes).unwrap();
        bytes
    }

    pub fn option(&mut self, option: u32, data: &[u8]) {
        let mut out = IHAVEOPT.to_be_bytes().to_vec();
        out.extend_from_slice(&option.to_be_bytes());
        out.extend_from_slice(&(data.len() as u32).to_be_bytes());
        out.extend_from_slice(data);
        self.send(&out);
    }

    /// Reads one option reply: (reply type, data).
    pub fn option_reply(&mut self) -> (u32, Vec<u8>) {
        let header = self.read(20);
        assert_eq!(
            u64::from_be_bytes(header[0..8].try_into().unwrap()),
            0x0003_e889_0455_65a9
        );
        let kind = u32::from_be_bytes(header[12..16].try_into().unwrap());
        let length = u32::from_be_bytes(header[16..20].try_into().unwrap());
        (kind, self.read(length as usize))
    }

    /// True when the server has closed the connection (EOF or reset).
    pub fn is_closed(&mut self) -> bool {
        let mut byte = [0u8; 1];
        loop {
            match self.stream.read(&mut byte) {
                Ok(0) => return true,
                Ok(_) => continue,
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return true,
                Err(_) => return false,
            }
        }
    }

    /// NBD_OPT_GO on `name`; optionally structured replies and base:allocation first.
    pub fn go(address: &str, name: &str, structured: bool) -> Raw {
        let mut raw = Raw::start(address);
        if structured {
            raw.option(8, &[]);
            assert_eq!(raw.option_reply().0, 1);
            let mut data = name_payload(name);
            data.extend_from_slice(&1u32.to_be_bytes());
            data.extend_from_slice(&15u32.to_be_bytes());
            data.extend_from_slice(b"base:allocation");
            raw.option(10, &data);
            assert_eq!(raw.option_reply().0, 4);
            assert_eq!(raw.option_reply().0, 1);
        }
        raw.finish_go(name);
        raw
    }

    fn finish_go(&mut self, name: &str) {
        let mut data = name_payload(name);
        data.extend_from_slice(&0u16.to_be_bytes());
        self.option(7, &data);
        loop {
            let (kind, _) = self.option_reply();
            match kind {
                3 => continue,
                1 => break,
                other => panic!("GO failed with {other:#x}"),
            }
        }
    }

    pub fn request(&mut self, flags: u16, kind: u16, cookie: u64, offset: u64, length: u32, payload: &[u8]) {
        self.send(&request_bytes(flags, kind, cookie, offset, length, payload));
    }

    /// Reads a simple reply: (error, cookie).
    pub fn simple_reply(&mut self) -> (u32, u64) {
        let header = self.read(16);
        assert_eq!(u32::from_be_bytes(header[0..4].try_into().unwrap()), 0x6744_6698);
        (
            u32::from_be_bytes(header[4..8].try_into().unwrap()),
            u64::from_be_bytes(header[8..16].try_into().unwrap()),
        )
    }

    /// Reads one structured chunk: (flags, type, cookie, payload).
    pub fn chunk(&mut self) -> (u16, u16, u64, Vec<u8>) {
        let header = self.read(20);
        assert_eq!(u32::from_be_bytes(header[0..4].try_into().unwrap()), 0x668e_33ef);
        let flags = u16::from_be_bytes(header[4..6].try_into().unwrap());
        let kind = u16::from_be_bytes(header[6..8].try_into().unwrap());
        let cookie = u64::from_be_bytes(header[8..16].try_into().unwrap());
        let length = u32::from_be_bytes(header[16..20].try_into().unwrap());
        (flags, kind, cookie, self.read(length as usize))
    }
}

/// One request (header and payload) as sent on the wire.
pub fn request_bytes(flags: u16, kind: u16, cookie: u64, offset: u64, length: u32, payload: &[u8]) -> Vec<u8> {
    let mut out = REQUEST_MAGIC.to_be_bytes().to_vec();
    out.extend_from_slice(&flags.to_be_bytes());
    out.extend_from_slice(&kind.to_be_bytes());
    out.extend_from_slice(&cookie.to_be_bytes());
    out.extend_from_slice(&offset.to_be_bytes());
    out.extend_from_slice(&length.to_be_bytes());
    out.extend_from_slice(payload);
    out
}

pub fn name_payload(name: &str) -> Vec<u8> {
    let mut data = (name.len() as u32).to_be_bytes().to_vec();
    data.extend_from_slice(name.as_bytes());
    data
}
