//! The two pieces of S3's XML the loader reads: error documents (`<Code>`, `<Message>`) and
//! ListObjectsV2 pages. Both are flat, machine-written documents, so a tag scanner with entity
//! decoding covers them without an XML dependency.

use super::client::Object;

/// Text of the first `<name>…</name>` in `xml`, entities decoded.
pub fn tag(xml: &str, name: &str) -> Option<String> {
    let open = format!("<{name}>");
    let close = format!("</{name}>");
    let a = xml.find(&open)? + open.len();
    let b = a + xml[a..].find(&close)?;
    Some(unescape(&xml[a..b]))
}

/// Every `<name>…</name>` block's inner text, in order (not decoded).
fn blocks<'a>(xml: &'a str, name: &str) -> Vec<&'a str> {
    let open = format!("<{name}>");
    let close = format!("</{name}>");
    let mut out = Vec::new();
    let mut rest = xml;
    while let Some(a) = rest.find(&open) {
        let inner = &rest[a + open.len()..];
        match inner.find(&close) {
            Some(b) => {
                out.push(&inner[..b]);
                rest = &inner[b + close.len()..];
            }
            None => break,
        }
    }
    out
}

fn unescape(s: &str) -> String {
    if !s.contains('&') {
        return s.to_string();
    }
    let mut out = String::with_capacity(s.len());
    let mut rest = s;
    while let Some(i) = rest.find('&') {
        out.push_str(&rest[..i]);
        let after = &rest[i..];
        let end = after.find(';').filter(|&e| e <= 10);
        let decoded = end.and_then(|e| {
            let ent = &after[1..e];
            let c = match ent {
                "amp" => Some('&'),
                "lt" => Some('<'),
                "gt" => Some('>'),
                "quot" => Some('"'),
                "apos" => Some('\''),
                _ if ent.starts_with("#x") => u32::from_str_radix(&ent[2..], 16)
                    .ok()
                    .and_then(char::from_u32),
                _ if ent.starts_with('#') => ent[1..].parse().ok().and_then(char::from_u32),
                _ => None,
            };
            c.map(|c| (c, e))
        });
        match decoded {
            Some((c, e)) => {
                out.push(c);
                rest = &after[e + 1..];
            }
            None => {
                out.push('&');
                rest = &after[1..];
            }
        }
    }
    out.push_str(rest);
    out
}

/// The objects of one ListObjectsV2 page and the continuation token of the next, if any.
pub fn list_page(xml: &str) -> Result<(Vec<Object>, Option<String>), String> {
    if !xml.contains("<ListBucketResult") {
        return Err(format!(
            "not a ListBucketResult: {}",
            xml.chars().take(120).collect::<String>()
        ));
    }
    let mut objects = Vec::new();
    for c in blocks(xml, "Contents") {
        let key = tag(c, "Key").ok_or("an entry without <Key>")?;
        let size = tag(c, "Size")
            .and_then(|s| s.trim().parse::<u64>().ok())
            .ok_or_else(|| format!("{key}: no <Size>"))?;
        let etag = tag(c, "ETag").unwrap_or_default();
        objects.push(Object { key, size, etag });
    }
    let truncated = tag(xml, "IsTruncated").is_some_and(|t| t.trim() == "true");
    let next = if truncated {
        Some(
            tag(xml, "NextContinuationToken")
                .ok_or("truncated page without a continuation token")?,
        )
    } else {
        None
    };
    Ok((objects, next))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_a_listing_and_an_error() {
        let page = r#"<?xml version="1.0" encoding="UTF-8"?>
<ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/"><Name>b</Name><Prefix>m/</Prefix>
<IsTruncated>true</IsTruncated><NextContinuationToken>tok&amp;1</NextContinuationToken>
<Contents><Key>m/config.json</Key><LastModified>2026-01-01T00:00:00.000Z</LastModified>
<ETag>&quot;9b2cf535f27731c974343645a3985328&quot;</ETag><Size>713</Size></Contents>
<Contents><Key>m/a&amp;b &#x263A;.safetensors</Key><ETag>"e-2"</ETag><Size>12</Size></Contents>
</ListBucketResult>"#;
        let (objs, next) = list_page(page).unwrap();
        assert_eq!(next.as_deref(), Some("tok&1"));
        assert_eq!(objs.len(), 2);
        assert_eq!(objs[0].key, "m/config.json");
        assert_eq!(objs[0].size, 713);
        assert_eq!(objs[0].etag, "\"9b2cf535f27731c974343645a3985328\"");
        assert_eq!(objs[1].key, "m/a&b \u{263A}.safetensors");
        let err = "<Error><Code>NoSuchKey</Code><Message>The key &lt;x&gt; does not exist</Message></Error>";
        assert_eq!(tag(err, "Code").as_deref(), Some("NoSuchKey"));
        assert_eq!(
            tag(err, "Message").as_deref(),
            Some("The key <x> does not exist")
        );
        assert!(list_page(err).is_err());
    }
}
