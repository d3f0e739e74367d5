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
