//! Unit tests of framing and startup decoding on exact bytes, including hostile input.

use super::frame::{next_frame, FrameError};
use super::message::*;
use super::startup::{next_startup, options_settings, StartupError, StartupPacket};
use bytes::BytesMut;

fn frame(tag: u8, body: &[u8]) -> Vec<u8> {
    let mut v = vec![tag];
    v.extend_from_slice(&((body.len() + 4) as u32).to_be_bytes());
    v.extend_from_slice(body);
    v
}

#[test]
fn frames_are_split_by_length() {
    let mut bytes = frame(b'Q', b"SELECT 1\0");
    bytes.extend(frame(b'S', b""));
    let (tag, len) = next_frame(&bytes, 1 << 20).unwrap().unwrap();
    assert_eq!((tag, len), (b'Q', 14));
    let (tag, len) = next_frame(&bytes[14..], 1 << 20).unwrap().unwrap();
    assert_eq!((tag, len), (b'S', 5));
}

#[test]
fn incomplete_frames_wait_for_more() {
    let bytes = frame(b'Q', b"SELECT 1\0");
    for cut in 0..bytes.len() {
        assert_eq!(
            next_frame(&bytes[..cut], 1 << 20).unwrap(),
            None,
            "cut at {cut}"
        );
    }
}

#[test]
fn short_huge_and_negative_lengths_are_errors() {
    assert_eq!(
        next_frame(&[b'Q', 0, 0, 0, 3], 1 << 20),
        Err(FrameError::TooShort {
            tag: 'Q',
            length: 3
        })
    );
    assert!(matches!(
        next_frame(&[b'Q', 0, 0x10, 0, 1], 1 << 20),
        Err(FrameError::TooLarge { .. })
    ));
    assert!(matches!(
        next_frame(&[b'Q', 0xff, 0xff, 0xff, 0xfe], 1 << 20),
        Err(FrameError::TooLarge { .. })
    ));
}

/// Messages as postgres-protocol's encoders (tokio-postgres's) write them, with what
/// [`Frontend`] calls them.
fn encoded_messages() -> Vec<(Frontend, Vec<u8>)> {
    use postgres_protocol::message::frontend;
    use postgres_protocol::IsNull;
    let mut out = Vec::new();
    let mut push = |kind, f: &dyn Fn(&mut BytesMut)| {
        let mut buf = BytesMut::new();
        f(&mut buf);
        out.push((kind, buf.to_vec()));
    };
    push(Frontend::Query, &|b| {
        frontend::query("SELECT 1", b).unwrap()
    });
    push(Frontend::Query, &|b| frontend::query("", b).unwrap());
    push(Frontend::Parse, &|b| {
        frontend::parse("s1", "SELECT $1, $2", [23, 25], b).unwrap()
    });
    push(Frontend::Parse, &|b| {
        frontend::parse("", "BEGIN", [], b).unwrap()
    });
    push(Frontend::Bind, &|b| {
        let values: [Option<&[u8]>; 3] = [Some(b"41"), None, Some(b"")];
        frontend::bind(
            "p1",
            "s1",
            [1i16, 0, 1],
            values,
            |v, buf| match v {
                Some(v) => {
                    buf.extend_from_slice(v);
                    Ok(IsNull::No)
                }
                None => Ok(IsNull::Yes),
            },
            [1i16],
            b,
        )
        .map_err(|_| "bind")
        .unwrap()
    });
    push(Frontend::Bind, &|b| {
        frontend::bind(
            "",
            "",
            [],
            [0u8; 0],
            |_, _| Ok::<_, Box<dyn std::error::Error + Sync + Send>>(IsNull::No),
            [],
            b,
        )
        .map_err(|_| "bind")
        .unwrap()
    });
    push(Frontend::Execute, &|b| {
        frontend::execute("p1", 10, b).unwrap()
    });
    push(Frontend::Describe, &|b| {
        frontend::describe(b'S', "s1", b).unwrap()
    });
    push(Frontend::Close, &|b| frontend::close(b'P', "", b).unwrap());
    push(Frontend::Sync, &|b| frontend::sync(b));
    push(Frontend::Flush, &|b| frontend::flush(b));
    // FunctionCall has no encoder there: oid, one text format code, two arguments (one
    // NULL), a text result.
    let mut body = 177u32.to_be_bytes().to_vec();
    body.extend([
        0, 1, 0, 0, 0, 2, 0, 0, 0, 1, b'7', 0xff, 0xff, 0xff, 0xff, 0, 0,
    ]);
    out.push((Frontend::FunctionCall, frame(b'F', &body)));
    out
}

/// Whether pgfence takes `frame` for a well-formed message: the function that reads it,
/// or [`well_formed`] for the messages pgfence forwards unread.
fn accepted(kind: Frontend, frame: &[u8]) -> bool {
    match kind {
        Frontend::Query => query_text(frame).is_some(),
        Frontend::Parse => parse_message(frame).is_some(),
        Frontend::Bind => bind_names(frame).is_some(),
        Frontend::Execute => execute_portal(frame).is_some(),
        Frontend::Close => target(frame).is_some(),
        _ => well_formed(kind, frame),
    }
}

#[test]
fn well_formed_messages_pass_and_every_cut_or_extension_fails() {
    for (kind, msg) in encoded_messages() {
        assert_eq!(Frontend::from_tag(msg[0]), Some(kind));
        assert!(accepted(kind, &msg), "{kind:?} {msg:?}");
        let body = &msg[5..];
        for cut in 0..body.len() {
            let short = frame(msg[0], &body[..cut]);
            assert!(!accepted(kind, &short), "{kind:?} cut to {cut}: {short:?}");
        }
        let mut long = body.to_vec();
        long.push(0);
        assert!(!accepted(kind, &frame(msg[0], &long)), "{kind:?} extended");
    }
}

#[test]
fn counts_and_lengths_that_overrun_are_malformed() {
    // Bind: one parameter of length 5 with 2 bytes; a length of -2; a count of 0xFFFF.
    let bind = |values: &[u8]| {
        let mut body = b"\0\0\0\0".to_vec();
        body.extend_from_slice(values);
        body.extend([0, 0]);
        frame(b'B', &body)
    };
    assert!(accepted(
        Frontend::Bind,
        &bind(&[0, 1, 0, 0, 0, 2, b'4', b'1'])
    ));
    assert!(!accepted(
        Frontend::Bind,
        &bind(&[0, 1, 0, 0, 0, 5, b'4', b'1'])
    ));
    assert!(!accepted(
        Frontend::Bind,
        &bind(&[0, 1, 0xff, 0xff, 0xff, 0xfe])
    ));
    assert!(!accepted(Frontend::Bind, &bind(&[0xff, 0xff])));
    // Parse claiming parameter types it does not hold.
    assert!(!accepted(
        Frontend::Parse,
        &frame(b'P', b"\0SELECT 1\0\0\x02\0\0\0\x17")
    ));
    // Copy messages, Terminate and passwords are not read: any body.
    for tag in [b'd', b'c', b'f', b'X', b'p'] {
        let kind = Frontend::from_tag(tag).unwrap();
        assert!(accepted(kind, &frame(tag, b"\xff\x00garbage")));
    }
}

#[test]
fn random_bytes_never_panic() {
    let mut seed = 0x9e3779b97f4a7c15u64;
    for _ in 0..20_000 {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        let len = (seed % 40) as usize;
        let bytes: Vec<u8> = (0..len).map(|i| (seed >> (i % 8 * 8)) as u8).collect();
        let _ = next_frame(&bytes, 1 << 20);
        let _ = next_startup(&bytes);
        let _ = error_fields(&bytes[..]);
        if bytes.len() >= 5 {
            let _ = query_text(&bytes);
            let _ = parse_message(&bytes);
            let _ = bind_names(&bytes);
            let _ = target(&bytes);
            let _ = first_column(&bytes);
            for tag in *b"QPBEDCSHFdcfXp" {
                let _ = well_formed(Frontend::from_tag(tag).unwrap(), &bytes);
            }
        }
    }
}

fn startup_bytes(version: u32, params: &[(&str, &str)]) -> Vec<u8> {
    let mut body = version.to_be_bytes().to_vec();
    for (k, v) in params {
        body.extend_from_slice(k.as_bytes());
        body.push(0);
        body.extend_from_slice(v.as_bytes());
        body.push(0);
    }
    body.push(0);
    let mut v = ((body.len() + 4) as u32).to_be_bytes().to_vec();
    v.extend(body);
    v
}

#[test]
fn startup_message_is_decoded() {
    let bytes = startup_bytes(196608, &[("user", "app"), ("database", "billing")]);
    let (packet, n) = next_startup(&bytes).unwrap().unwrap();
    assert_eq!(n, bytes.len());
    let StartupPacket::Startup(s) = packet else {
        panic!("not a startup message")
    };
    assert_eq!(s.user(), "app");
    assert_eq!(s.database(), "billing");
}

/// `replication` as PostgreSQL reads it: `database`, or a boolean.
#[test]
fn replication_connections_are_recognised() {
    let replication = |value: Option<&str>| {
        let mut params = vec![("user", "app")];
        params.extend(value.map(|v| ("replication", v)));
        let bytes = startup_bytes(196608, &params);
        let Some((StartupPacket::Startup(s), _)) = next_startup(&bytes).unwrap() else {
            panic!("not a startup message")
        };
        s.replication()
    };
    assert!(!replication(None));
    for yes in ["database", "true", "on", "yes", "1", "TRUE", "t", "y"] {
        assert!(replication(Some(yes)), "{yes}");
    }
    for no in ["false", "off", "of", "no", "0", "FALSE", "f", "n", "fal"] {
        assert!(!replication(Some(no)), "{no}");
    }
}

#[test]
fn special_requests_are_recognised() {
    let ssl = [0, 0, 0, 8, 0x04, 0xd2, 0x16, 0x2f];
    assert_eq!(
        next_startup(&ssl).unwrap(),
        Some((StartupPacket::SslRequest, 8))
    );
    let gss = [0, 0, 0, 8, 0x04, 0xd2, 0x16, 0x30];
    assert_eq!(
        next_startup(&gss).unwrap(),
        Some((StartupPacket::GssEncRequest, 8))
    );
    let mut cancel = vec![0, 0, 0, 16, 0x04, 0xd2, 0x16, 0x2e];
    cancel.extend_from_slice(&7i32.to_be_bytes());
    cancel.extend_from_slice(&(-9i32).to_be_bytes());
    assert_eq!(
        next_startup(&cancel).unwrap(),
        Some((StartupPacket::Cancel { pid: 7, key: -9 }, 16))
    );
}

#[test]
fn bad_startup_packets_are_errors() {
    assert_eq!(
        next_startup(&[0, 0, 0, 4, 0, 3, 0, 0]),
        Err(StartupError::Length(4))
    );
    assert_eq!(
        next_startup(&[0xff, 0xff, 0xff, 0xff]),
        Err(StartupError::Length(-1))
    );
    assert!(matches!(
        next_startup(b"GET / HTTP/1.1\r\n"),
        Err(StartupError::Length(_))
    ));
    let v2 = startup_bytes(0x0002_0000, &[("user", "a")]);
    assert_eq!(
        next_startup(&v2),
        Err(StartupError::Version { major: 2, minor: 0 })
    );
    let no_user = startup_bytes(196608, &[("database", "a")]);
    assert_eq!(next_startup(&no_user), Err(StartupError::NoUser));
    let mut unterminated = startup_bytes(196608, &[("user", "a")]);
    let last = unterminated.len() - 1;
    unterminated[last] = b'x';
    assert!(matches!(
        next_startup(&unterminated),
        Err(StartupError::Layout(_))
    ));
}

#[test]
fn options_settings_are_parsed_like_postgres() {
    let s = options_settings(
        b"-c fencing.token=34 --fencing.resource=billing -cwork_mem=1MB -c a=b\\ c",
    );
    assert_eq!(
        s,
        vec![
            ("fencing.token".to_string(), "34".to_string()),
            ("fencing.resource".to_string(), "billing".to_string()),
            ("work_mem".to_string(), "1MB".to_string()),
            ("a".to_string(), "b c".to_string()),
        ]
    );
    // getopt: switches combine, an argument is the rest of its word or the next word,
    // and `--` ends the switches.
    let pairs = |options: &[u8]| -> Vec<(String, String)> { options_settings(options) };
    let token = |v: &str| vec![("fencing.token".to_string(), v.to_string())];
    assert_eq!(pairs(b"-ec fencing.token=400"), token("400"));
    assert_eq!(pairs(b"-efcfencing.token=401"), token("401"));
    assert_eq!(pairs(b"-B 100 -c fencing.token=402"), token("402"));
    assert_eq!(pairs(b"-B-c -c fencing.token=403"), token("403"));
    assert_eq!(
        pairs(b"-c fencing.token=404 -- -c fencing.token=1"),
        token("404")
    );
    assert_eq!(pairs(b"stray -c fencing.token=405"), token("405"));
    // pg_split_opts splits at C's isspace, vertical tab included; names fold ASCII only
    // (U+212A KELVIN SIGN is not `k` to PostgreSQL).
    assert_eq!(pairs(b"-c\x0bfencing.token=406"), token("406"));
    assert_eq!(
        pairs("-c fencing.to\u{212A}en=1".as_bytes()),
        vec![("fencing.to\u{212A}en".to_string(), "1".to_string())]
    );
    assert_eq!(pairs(b"-c FENCING.TOKEN=407"), token("407"));
    assert_eq!(pairs(b"-c"), vec![]);
    assert_eq!(pairs(b"-c noequals"), vec![]);
}

#[test]
fn built_messages_have_exact_bytes() {
    let mut out = BytesMut::new();
    ready_for_query(&mut out, b'T');
    assert_eq!(&out[..], &[b'Z', 0, 0, 0, 5, b'T']);
    out.clear();
    error_response(
        &mut out,
        &ErrorMessage {
            severity: "ERROR",
            code: "FN001",
            message: "m",
            detail: None,
            hint: None,
        },
    );
    assert_eq!(&out[..], b"E\0\0\0\x1dSERROR\0VERROR\0CFN001\0Mm\0\0");
    let fields = error_fields(&out);
    assert_eq!(fields.code, b"FN001");
    assert_eq!(fields.message, b"m");
}
