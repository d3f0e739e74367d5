//! Certificates for the TLS tests, made fresh by each test: a CA, a certificate it signed
//! for `localhost` and `127.0.0.1` and a client certificate for `postgres`, as PEM files in a temporary directory (removed on
//! drop), and a blocking TLS client for byte-exact tests.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, DnType, IsCa, KeyPair};

/// A CA and a server certificate it signed, on disk.
pub struct TestCerts {
    dir: tempfile::TempDir,
    /// The CA certificate clients trust (`sslrootcert`).
    pub ca_file: PathBuf,
    /// The server certificate, for `client_tls.cert_file`.
    pub cert_file: PathBuf,
    /// Its key, for `client_tls.key_file`.
    pub key_file: PathBuf,
    /// A client certificate from the same CA, for the user `postgres` (`upstream.sslcert`).
    pub client_cert_file: PathBuf,
    /// Its key (`upstream.sslkey`).
    pub client_key_file: PathBuf,
    ca_der: Vec<u8>,
}

impl TestCerts {
    /// A new CA named `ca_name` and a server certificate signed by it for `localhost` and
    /// `127.0.0.1`.
    pub fn new(ca_name: &str) -> TestCerts {
        TestCerts::for_names(ca_name, &["localhost", "127.0.0.1"])
    }

    /// A new CA named `ca_name` and a server certificate signed by it for `names` (host
    /// names or IP addresses).
    pub fn for_names(ca_name: &str, names: &[&str]) -> TestCerts {
        let dir = tempfile::tempdir().expect("temporary directory for certificates");
        let mut ca_params = CertificateParams::new(Vec::<String>::new()).expect("CA params");
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca_params
            .distinguished_name
            .push(DnType::CommonName, ca_name);
        let ca = CertifiedIssuer::self_signed(ca_params, KeyPair::generate().expect("CA key"))
            .expect("self-signed CA");
        let key = KeyPair::generate().expect("server key");
        let mut params =
            CertificateParams::new(names.iter().map(|n| n.to_string()).collect::<Vec<_>>())
                .expect("server params");
        params.distinguished_name.push(DnType::CommonName, names[0]);
        let cert = params.signed_by(&key, &ca).expect("server certificate");
        let client_key = KeyPair::generate().expect("client key");
        let mut client_params = CertificateParams::new(Vec::<String>::new()).expect("params");
        client_params
            .distinguished_name
            .push(DnType::CommonName, crate::SUPERUSER);
        let client = client_params
            .signed_by(&client_key, &ca)
            .expect("client certificate");
        let write = |name: &str, text: &str| {
            let path = dir.path().join(name);
            std::fs::write(&path, text).unwrap_or_else(|e| panic!("write {name}: {e}"));
            path
        };
        TestCerts {
            ca_file: write("ca.crt", &ca.pem()),
            cert_file: write("server.crt", &cert.pem()),
            key_file: write("server.key", &key.serialize_pem()),
            client_cert_file: write("client.crt", &client.pem()),
            client_key_file: write("client.key", &client_key.serialize_pem()),
            ca_der: ca.der().to_vec(),
            dir,
        }
    }

    /// The directory holding the files.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// A libpq connection string's TLS part that verifies pgfence's certificate and name.
    pub fn verify_full(&self) -> String {
        format!(
            "sslmode=verify-full sslrootcert={}",
            crate::quote_conn_value(&self.ca_file.display().to_string())
        )
    }

    /// rustls' client configuration trusting this CA.
    pub fn client_config(&self) -> Arc<rustls::ClientConfig> {
        let mut roots = rustls::RootCertStore::empty();
        roots
            .add(rustls::pki_types::CertificateDer::from(self.ca_der.clone()))
            .expect("CA certificate");
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        Arc::new(
            rustls::ClientConfig::builder_with_provider(provider)
                .with_safe_default_protocol_versions()
                .expect("TLS versions")
                .with_root_certificates(roots)
                .with_no_client_auth(),
        )
    }

    /// Connects to `addr`, sends an SSLRequest, expects `S` and runs the handshake for
    /// `localhost`: a blocking TLS stream for raw protocol bytes.
    pub fn connect(
        &self,
        addr: std::net::SocketAddr,
    ) -> rustls::StreamOwned<rustls::ClientConnection, TcpStream> {
        let mut tcp = TcpStream::connect(addr).expect("connect to pgfence");
        tcp.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        tcp.write_all(&crate::wire::ssl_request()).unwrap();
        let mut answer = [0u8; 1];
        tcp.read_exact(&mut answer)
            .expect("an answer to SSLRequest");
        assert_eq!(answer[0], b'S', "pgfence accepts the SSLRequest");
        self.handshake(tcp, self.client_config())
            .expect("TLS handshake with pgfence")
    }

    /// Connects to `addr` and opens with a TLS ClientHello (PostgreSQL 17's
    /// `sslnegotiation=direct`), offering the ALPN protocol `postgresql` when `alpn`.
    pub fn connect_direct(
        &self,
        addr: std::net::SocketAddr,
        alpn: bool,
    ) -> std::io::Result<rustls::StreamOwned<rustls::ClientConnection, TcpStream>> {
        let tcp = TcpStream::connect(addr).expect("connect to pgfence");
        tcp.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut config = (*self.client_config()).clone();
        if alpn {
            config.alpn_protocols = vec![b"postgresql".to_vec()];
        }
        self.handshake(tcp, Arc::new(config))
    }

    fn handshake(
        &self,
        tcp: TcpStream,
        config: Arc<rustls::ClientConfig>,
    ) -> std::io::Result<rustls::StreamOwned<rustls::ClientConnection, TcpStream>> {
        let name = rustls::pki_types::ServerName::try_from("localhost").unwrap();
        let conn = rustls::ClientConnection::new(config, name).unwrap();
        let mut tls = rustls::StreamOwned::new(conn, tcp);
        while tls.conn.is_handshaking() {
            tls.conn.complete_io(&mut tls.sock)?;
        }
        Ok(tls)
    }
}
