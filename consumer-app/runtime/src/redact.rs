//! Connection URLs without their passwords, for logs.

/// `scheme://user:secret@host/…` → `scheme://user:***@host/…`.
///
/// Works on the text (no URL parser), so it also hides the password of a URL
/// that would not parse.
pub fn redact_url(url: &str) -> String {
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
    let shown = match userinfo.find(':') {
        Some(colon) => format!("{}:***", &userinfo[..colon]),
        None => userinfo.to_owned(),
    };
    format!("{}{}{}", &url[..rest_start], shown, &url[rest_start + at..])
}

#[cfg(test)]
mod tests {
    use super::redact_url;

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
    }
}
