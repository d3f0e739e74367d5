use super::*;

#[test]
fn example_file_parses_and_validates() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../pgfence.example.toml");
    let config = Config::from_file(&path).expect("pgfence.example.toml must parse");
    assert_eq!(config.listen.port(), 6432);
}

#[test]
fn empty_file_gives_defaults() {
    let config: Config = toml::from_str("").unwrap();
    assert_eq!(config, Config::default());
    config.validate().unwrap();
}

#[test]
fn unknown_keys_are_rejected() {
    let err = toml::from_str::<Config>("[upstream]\nhots = \"x\"\n").unwrap_err();
    assert!(err.to_string().contains("hots"), "{err}");
}

#[test]
fn durations_take_units() {
    let config: Config = toml::from_str("[limits]\nshutdown_timeout = \"2m 5s\"\n").unwrap();
    assert_eq!(config.limits.shutdown_timeout, Duration::from_secs(125));
}

#[test]
fn keepalive_timing_is_optional_and_checked() {
    let config: Config = toml::from_str(
        "[limits]\ntcp_keepalives_idle = \"30s\"\ntcp_keepalives_interval = \"5s\"\ntcp_keepalives_count = 3\n",
    )
    .unwrap();
    assert!(config.limits.tcp_keepalive);
    assert_eq!(
        config.limits.tcp_keepalives_idle,
        Some(Duration::from_secs(30))
    );
    assert_eq!(
        config.limits.tcp_keepalives_interval,
        Some(Duration::from_secs(5))
    );
    assert_eq!(config.limits.tcp_keepalives_count, Some(3));
    config.validate().unwrap();
    for bad in [
        "tcp_keepalives_idle = \"500ms\"",
        "tcp_keepalives_idle = \"40000s\"",
        "tcp_keepalives_idle = \"1.5s\"",
        "tcp_keepalives_interval = \"0s\"",
        "tcp_keepalives_count = 0",
        "tcp_keepalives_count = 1000",
    ] {
        let config: Config = toml::from_str(&format!("[limits]\n{bad}\n")).unwrap();
        let err = config.validate().unwrap_err().to_string();
        assert!(err.contains(" from 1"), "{bad}: {err}");
    }
}

/// Timeouts that would refuse every client at once (a reload once took `0s`).
#[test]
fn zero_timeouts_are_refused() {
    for bad in ["startup_timeout = \"0s\"", "connect_timeout = \"10ms\""] {
        let config: Config = toml::from_str(&format!("[limits]\n{bad}\n")).unwrap();
        let err = config.validate().unwrap_err().to_string();
        assert!(err.contains("at least 100ms"), "{bad}: {err}");
    }
}

#[test]
fn bad_resource_names_are_rejected() {
    let config: Config = toml::from_str("[fence.resources.\"bad name\"]\n").unwrap();
    assert!(config.validate().is_err());
}

#[test]
fn default_resource_prefers_the_user_entry() {
    let config: Config = toml::from_str(
        r#"
[[fence.defaults]]
database = "app"
resource = "billing"
[[fence.defaults]]
database = "app"
user = "reporting"
resource = "reports"
"#,
    )
    .unwrap();
    assert_eq!(
        config.fence.default_resource("app", "alice"),
        Some("billing")
    );
    assert_eq!(
        config.fence.default_resource("app", "reporting"),
        Some("reports")
    );
    assert_eq!(config.fence.default_resource("other", "alice"), None);
}

#[test]
fn allow_missing_lists_allowing_resources() {
    let config: Config = toml::from_str(
        r#"
[fence.resources.billing]
[fence.resources.cache]
on_missing_token = "allow"
"#,
    )
    .unwrap();
    assert_eq!(config.fence.allow_missing(), vec!["cache".to_string()]);
    let config: Config = toml::from_str("[fence]\non_missing_token = \"allow\"\n").unwrap();
    assert_eq!(config.fence.allow_missing(), vec!["*".to_string()]);
}

#[test]
fn upstream_addresses_parse() {
    assert_eq!(
        Upstream::parse("db:6543").unwrap(),
        Upstream {
            host: "db".into(),
            port: 6543,
            ..Upstream::default()
        }
    );
    assert_eq!(Upstream::parse("db").unwrap().port, 5432);
    assert_eq!(
        Upstream::parse("[::1]:5433").unwrap(),
        Upstream {
            host: "::1".into(),
            port: 5433,
            ..Upstream::default()
        }
    );
    assert!(Upstream::parse("db:x").is_err());
    assert!(Upstream::parse("").is_err());
    // A socket directory, as libpq and PgBouncer take `host`.
    let socket = Upstream::parse("/var/run/postgresql:5433").unwrap();
    assert_eq!(socket.host, "/var/run/postgresql");
    assert_eq!(socket.port, 5433);
    assert!(socket.is_socket_dir());
    assert_eq!(
        socket.socket_path().unwrap(),
        std::path::Path::new("/var/run/postgresql/.s.PGSQL.5433")
    );
    assert_eq!(Upstream::parse("/tmp").unwrap().port, 5432);
    assert!(!Upstream::parse("db:6543").unwrap().is_socket_dir());
    assert_eq!(Upstream::parse("db:6543").unwrap().socket_path(), None);
}

#[test]
fn overrides_win_over_the_file_and_survive_reload() {
    let dir = std::env::temp_dir().join(format!("pgfence-config-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("pgfence.toml");
    std::fs::write(
        &path,
        "listen = \"127.0.0.1:7000\"\n[upstream]\nport = 6000\n",
    )
    .unwrap();
    let source = Source {
        path: Some(path.clone()),
        overrides: Overrides {
            upstream: Some(Upstream::parse("10.0.0.1:5999").unwrap()),
            ..Overrides::default()
        },
    };
    let config = source.load().unwrap();
    assert_eq!(config.listen.port(), 7000);
    assert_eq!(config.upstream.port, 5999);
    std::fs::write(&path, "listen = \"127.0.0.1:7001\"\n").unwrap();
    let reloaded = source.load().unwrap();
    assert_eq!(reloaded.upstream.port, 5999);
    assert_eq!(config.restart_only_changes(&reloaded), vec!["listen"]);
    std::fs::write(&path, "listen = 12\n").unwrap();
    assert!(source.load().is_err());
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn docker_compose_config_parses() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/pgfence.toml");
    let config = Config::from_file(&path).expect("deploy/pgfence.toml must parse");
    assert_eq!(config.upstream.host, "postgres");
    assert!(config.fence.install.is_some());
}

#[test]
fn client_tls_modes_and_their_files() {
    let config: Config = toml::from_str(
        "[client_tls]\nsslmode = \"prefer\"\ncert_file = \"/etc/pgfence/c.pem\"\nkey_file = \"/etc/pgfence/k.pem\"\n",
    )
    .unwrap();
    assert_eq!(config.client_tls.sslmode, ClientSslMode::Allow);
    config.validate().unwrap();
    let config: Config = toml::from_str("[client_tls]\nsslmode = \"require\"\n").unwrap();
    let err = config.validate().unwrap_err().to_string();
    assert!(err.contains("needs client_tls.cert_file"), "{err}");
    let err = toml::from_str::<Config>("[client_tls]\nsslmode = \"verify\"\n").unwrap_err();
    assert!(err.to_string().contains("verify-full"), "{err}");
    assert_eq!("prefer".parse::<ClientSslMode>(), Ok(ClientSslMode::Allow));
    assert_eq!(ClientSslMode::Require.to_string(), "require");
    // The verify modes need the CA file that signs the clients' certificates.
    let files = "cert_file = \"/c.pem\"\nkey_file = \"/k.pem\"\n";
    for mode in ["verify-ca", "verify-full"] {
        let config: Config =
            toml::from_str(&format!("[client_tls]\nsslmode = \"{mode}\"\n{files}")).unwrap();
        let err = config.validate().unwrap_err().to_string();
        assert!(err.contains("needs client_tls.ca_file"), "{err}");
        let config: Config = toml::from_str(&format!(
            "[client_tls]\nsslmode = \"{mode}\"\n{files}ca_file = \"/ca.pem\"\n"
        ))
        .unwrap();
        config.validate().unwrap();
        assert_eq!(config.client_tls.sslmode.to_string(), mode);
        assert!(config.client_tls.sslmode.requires_tls());
        assert!(config.client_tls.sslmode.requires_certificate());
    }
    assert!(!ClientSslMode::Require.requires_certificate());
    assert!(!ClientSslMode::Allow.requires_tls());
    // A CA file with allow or require asks for certificates; with disable it is a mistake.
    let config: Config = toml::from_str(&format!(
        "[client_tls]\nsslmode = \"require\"\n{files}ca_file = \"/ca.pem\"\n"
    ))
    .unwrap();
    config.validate().unwrap();
    let config: Config = toml::from_str("[client_tls]\nca_file = \"/ca.pem\"\n").unwrap();
    let err = config.validate().unwrap_err().to_string();
    assert!(err.contains("no client would ever be asked"), "{err}");
}

#[test]
fn upstream_tls_modes_and_overrides() {
    let config: Config =
        toml::from_str("[upstream]\nsslmode = \"verify-full\"\nsslrootcert = \"/ca.pem\"\n")
            .unwrap();
    assert_eq!(config.upstream.sslmode, UpstreamSslMode::VerifyFull);
    config.validate().unwrap();
    let config: Config = toml::from_str("[upstream]\nsslmode = \"verify-ca\"\n").unwrap();
    let err = config.validate().unwrap_err().to_string();
    assert!(err.contains("needs upstream.sslrootcert"), "{err}");
    // --upstream changes where, not how.
    let mut config: Config = toml::from_str("[upstream]\nsslmode = \"require\"\n").unwrap();
    Overrides {
        upstream: Some(Upstream::parse("db:6543").unwrap()),
        ..Overrides::default()
    }
    .apply(&mut config);
    assert_eq!(
        (config.upstream.host.as_str(), config.upstream.port),
        ("db", 6543)
    );
    assert_eq!(config.upstream.sslmode, UpstreamSslMode::Require);
    assert_eq!(
        "verify-ca".parse::<UpstreamSslMode>(),
        Ok(UpstreamSslMode::VerifyCa)
    );
    assert!("allow".parse::<UpstreamSslMode>().is_err());
    let config: Config = toml::from_str(
        "[upstream]\nsslmode = \"require\"\nsslcert = \"/c.pem\"\nsslkey = \"/k.pem\"\n",
    )
    .unwrap();
    config.validate().unwrap();
    let config: Config =
        toml::from_str("[upstream]\nsslcert = \"/c.pem\"\nsslkey = \"/k.pem\"\n").unwrap();
    let err = config.validate().unwrap_err().to_string();
    assert!(err.contains("would never be sent"), "{err}");
}
