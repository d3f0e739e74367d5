//! Certificates for the TLS tests, made fresh by each test: a CA, a certificate it signed
//! for `localhost` and `127.0.0.1` and client certificates (`postgres`, and any other common
//! name on request), as PEM files in a temporary directory (removed on drop), and a
//! blocking TLS client for byte-exact tests.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, DnType, IsCa, KeyPair};

fn write(dir: &tempfile::TempDir, name: &str, text: &str) -> PathBuf {
    let path = dir.path().join(name);
    std::fs::write(&path, text).unwrap_or_else(|e| panic!("write {name}: {e}"));
    path
}

/// A certificate for the client `cn` signed by `ca`, and its key, written to `dir`.
fn client_certificate(
    dir: &tempfile::TempDir,
    ca: &CertifiedIssuer<'static, KeyPair>,
    cn: &str,
) -> (PathBuf, PathBuf) {
    let key = KeyPair::generate().expect("client key");
    let mut params = CertificateParams::new(Vec::<String>::new()).expect("params");
    params.distinguished_name.push(DnType::CommonName, cn);
    let cert = params.signed_by(&key, ca).expect("client certificate");
    let name = if cn == crate::SUPERUSER {
        "client".to_string()
    } else {
        format!("client-{cn}")
    };
    let key_file = write(dir, &format!("{name}.key"), &key.serialize_pem());
    // libpq refuses an `sslkey` that others may read.
    std::fs::set_permissions(
        &key_file,
        std::os::unix::fs::PermissionsExt::from_mode(0o600),
    )
    .expect("chmod 600 the client key");
    (write(dir, &format!("{name}.crt"), &cert.pem()), key_file)
}

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
    ca: CertifiedIssuer<'static, KeyPair>,
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
        let (client_cert_file, client_key_file) = client_certificate(&dir, &ca, crate::SUPERUSER);
        TestCerts {
            ca_file: write(&dir, "ca.crt", &ca.pem()),
            cert_file: write(&dir, "server.crt", &cert.pem()),
            key_file: write(&dir, "server.key", &key.serialize_pem()),
            client_cert_file,
            client_key_file,
            ca,
            dir,
        }
    }

    /// A client certificate from this CA with the common name `cn`, and its key, on disk
    /// (`sslcert`, `sslkey`).
    pub fn client_cert(&self, cn: &str) -> (PathBuf, PathBuf) {
        client_certificate(&self.dir, &self.ca, cn)
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
        Arc::new(self.client_config_builder().with_no_client_auth())
    }

    fn client_config_builder(
        &self,
    ) -> rustls::ConfigBuilder<rustls::ClientConfig, rustls::client::WantsClientCert> {
        let mut roots = rustls::RootCertStore::empty();
        roots.add(self.ca.der().clone()).expect("CA certificate");
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .expect("TLS versions")
            .with_root_certificates(roots)
    }

    /// Connects to `addr`, sends an SSLRequest, expects `S` and runs the handshake for
    /// `localhost`: a blocking TLS stream for raw protocol bytes.
    pub fn connect(
        &self,
        addr: std::net::SocketAddr,
    ) -> rustls::StreamOwned<rustls::ClientConnection, TcpStream> {
        self.connect_with(addr, self.client_config())
    }

    /// Like [`TestCerts::connect`], presenting the client certificate in `cert_file`
    /// (its key in `key_file`).
    pub fn connect_with_client_cert(
        &self,
        addr: std::net::SocketAddr,
        cert_file: &Path,
        key_file: &Path,
    ) -> rustls::StreamOwned<rustls::ClientConnection, TcpStream> {
        use rustls::pki_types::pem::PemObject;
        let certs = rustls::pki_types::CertificateDer::pem_file_iter(cert_file)
            .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
            .expect("client certificate");
        let key = rustls::pki_types::PrivateKeyDer::from_pem_file(key_file).expect("client key");
        let config = self
            .client_config_builder()
            .with_client_auth_cert(certs, key)
            .expect("client certificate and key");
        self.connect_with(addr, Arc::new(config))
    }

    fn connect_with(
        &self,
        addr: std::net::SocketAddr,
        config: Arc<rustls::ClientConfig>,
    ) -> rustls::StreamOwned<rustls::ClientConnection, TcpStream> {
        let mut tcp = TcpStream::connect(addr).expect("connect to pgfence");
        tcp.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        tcp.write_all(&crate::wire::ssl_request()).unwrap();
        let mut answer = [0u8; 1];
        tcp.read_exact(&mut answer)
            .expect("an answer to SSLRequest");
        assert_eq!(answer[0], b'S', "pgfence accepts the SSLRequest");
        self.handshake(tcp, config)
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
