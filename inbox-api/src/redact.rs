//! Connection URLs without their passwords, for logs and errors: every
//! crate that names a database or broker URL hides its password the same
//! way, from this one place.

/// `scheme://user:secret@host/…` → `scheme://user:***@host/…`.
///
/// Works on the text (no URL parser), so it also hides the password of a URL
/// that would not parse.
pub fn redact_url(url: &str) -> String {
    redact_query(&redact_userinfo(url))
}

/// `…?password=secret&sslpassword=…` (libpq's URL parameters) →
/// `…?password=***&…`.
fn redact_query(url: &str) -> String {
    let Some(start) = url.find('?') else {
        return url.to_owned();
    };
    let (base, query) = url.split_at(start + 1);
    let pairs: Vec<String> = query
        .split('&')
        .map(|pair| match pair.split_once('=') {
            Some((key, _)) if key == "password" || key == "sslpassword" => format!("{key}=***"),
            _ => pair.to_owned(),
        })
        .collect();
    format!("{base}{}", pairs.join("&"))
}

fn redact_userinfo(url: &str) -> String {
    let Some(scheme_end) = url.find("://") else {
        return url.to_owned();
    };
    let rest_start = scheme_end + 3;
    let rest = &url[rest_start..];
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let authority = &rest[..authority_end];
    let Some(at) = authority.rfind('@') else {
        return url.to_owned();
    };
    let userinfo = &authority[..at];
    // NATS reads a user without a password as a token (`nats://s3cr3t@h`):
    // the whole of it is the secret there.
    let token_scheme = matches!(&url[..scheme_end], "nats" | "tls" | "NATS" | "TLS");
    let shown = match userinfo.find(':') {
        Some(colon) => format!("{}:***", &userinfo[..colon]),
        None if token_scheme => "***".to_owned(),
        None => userinfo.to_owned(),
    };
    format!("{}{}{}", &url[..rest_start], shown, &url[rest_start + at..])
}

#[cfg(test)]
mod tests {
    use super::redact_url;

    #[test]
    fn a_nats_token_is_hidden() {
        assert_eq!(redact_url("nats://s3cr3t@h:4222"), "nats://***@h:4222");
        assert_eq!(redact_url("tls://u:p@h:4222"), "tls://u:***@h:4222");
        assert_eq!(redact_url("amqp://guest@h"), "amqp://guest@h");
    }

    #[test]
    fn passwords_are_hidden() {
        assert_eq!(
            redact_url("amqp://guest:guest@127.0.0.1:5672/%2f"),
            "amqp://guest:***@127.0.0.1:5672/%2f"
        );
        assert_eq!(
            redact_url("postgres://app:p@ss@db/x?sslmode=disable"),
            "postgres://app:***@db/x?sslmode=disable"
        );
        assert_eq!(
            redact_url("postgres://postgres@127.0.0.1:5432/test"),
            "postgres://postgres@127.0.0.1:5432/test"
        );
        assert_eq!(redact_url("not a url"), "not a url");
        assert_eq!(
            redact_url("postgres://h/db?user=u&password=pw&sslmode=require"),
            "postgres://h/db?user=u&password=***&sslmode=require"
        );
    }
}
