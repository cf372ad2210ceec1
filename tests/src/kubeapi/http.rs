//! The double's HTTP face: the REST paths kube-rs calls, answered from the
//! store, and watches streamed as the API server streams them
//! (newline-delimited `{"type": ..., "object": ...}`).

use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::http::{HeaderMap, Method, StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

use super::Shared;
use super::selector::Filter;
use super::store::{ApiError, Kind, seen_as};

/// One request as the double saw it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Seen {
    /// GET, POST, PUT, PATCH, DELETE.
    pub method: String,
    /// The path.
    pub path: String,
    /// The query.
    pub query: String,
    /// The content type of a write.
    pub content_type: Option<String>,
    /// The answer's code.
    pub code: u16,
    /// The field manager a write is recorded under, as the API server
    /// picks it: the `fieldManager` parameter, else the `User-Agent` up to
    /// its first `/`.
    pub field_manager: Option<String>,
}

fn answer(code: u16, v: &Value) -> Response {
    let status = StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    (
        status,
        [(header::CONTENT_TYPE, "application/json")],
        v.to_string(),
    )
        .into_response()
}

fn error(e: &ApiError) -> Response {
    answer(e.code, &e.status())
}

fn bad(message: impl Into<String>) -> ApiError {
    ApiError {
        code: 400,
        reason: "BadRequest",
        message: message.into(),
    }
}

/// Where a path points.
struct Target {
    kind: Kind,
    namespace: Option<String>,
    name: Option<String>,
    status: bool,
}

fn route(kinds: &[Kind], path: &str) -> Result<Target, ApiError> {
    let segs: Vec<&str> = path.trim_matches('/').split('/').collect();
    let not_found = || ApiError {
        code: 404,
        reason: "NotFound",
        message: format!("the server could not find the requested resource ({path})"),
    };
    let (group, version, rest) = match segs.as_slice() {
        ["api", v, rest @ ..] => ("", *v, rest),
        ["apis", g, v, rest @ ..] => (*g, *v, rest),
        _ => return Err(not_found()),
    };
    let (namespace, rest) = match rest {
        ["namespaces", ns, rest @ ..] if !rest.is_empty() => (Some((*ns).to_string()), rest),
        _ => (None, rest),
    };
    let (plural, name, status) = match rest {
        [p] => (*p, None, false),
        [p, n] => (*p, Some((*n).to_string()), false),
        [p, n, "status"] => (*p, Some((*n).to_string()), true),
        _ => return Err(not_found()),
    };
    let kind = *kinds
        .iter()
        .find(|k| k.group == group && k.version == version && k.plural == plural)
        .ok_or_else(not_found)?;
    if namespace.is_some() != kind.namespaced && (name.is_some() || !kind.namespaced) {
        return Err(not_found());
    }
    if status && !kind.status {
        return Err(not_found());
    }
    Ok(Target {
        kind,
        namespace,
        name,
        status,
    })
}

fn query(uri: &Uri) -> HashMap<String, String> {
    uri.query()
        .unwrap_or("")
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (k, v) = p.split_once('=').unwrap_or((p, ""));
            (decode(k), decode(v))
        })
        .collect()
}

/// Percent-decoding (and `+` as space) of a query component.
fn decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'%' if i + 2 < b.len() => {
                let hex = std::str::from_utf8(&b[i + 1..i + 3]).unwrap_or("");
                match u8::from_str_radix(hex, 16) {
                    Ok(v) => {
                        out.push(v);
                        i += 3;
                        continue;
                    }
                    Err(_) => out.push(b'%'),
                }
            }
            b'+' => out.push(b' '),
            c => out.push(c),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// A continue token whose snapshot is gone, as the API server answers
/// one older than its compaction.
fn expired_continue() -> ApiError {
    ApiError {
        code: 410,
        reason: "Expired",
        message: "The provided continue parameter is too old to display a consistent list result. You can start a new list without the continue parameter.".into(),
    }
}

/// Serves one request.
pub async fn serve(
    shared: Arc<Shared>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let content_type = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .map(|s| s.split(';').next().unwrap_or(s).trim().to_string());
    let field_manager = uri
        .query()
        .unwrap_or("")
        .split('&')
        .find_map(|kv| kv.strip_prefix("fieldManager="))
        .map(str::to_owned)
        .or_else(|| {
            headers
                .get(header::USER_AGENT)
                .and_then(|v| v.to_str().ok())
                .map(|ua| ua.split('/').next().unwrap_or(ua).to_owned())
        });
    let r = handle(&shared, &method, &uri, content_type.as_deref(), &body).await;
    let code = match &r {
        Ok(resp) => resp.status().as_u16(),
        Err(e) => e.code,
    };
    shared.seen(Seen {
        method: method.to_string(),
        path: uri.path().to_string(),
        query: uri.query().unwrap_or("").to_string(),
        content_type,
        code,
        field_manager,
    });
    match r {
        Ok(resp) => resp,
        Err(e) => error(&e),
    }
}

async fn handle(
    shared: &Arc<Shared>,
    method: &Method,
    uri: &Uri,
    content_type: Option<&str>,
    body: &Bytes,
) -> Result<Response, ApiError> {
    let t = route(&shared.kinds, uri.path())?;
    let q = query(uri);
    let ns = t.namespace.clone().unwrap_or_default();
    let json_body = || -> Result<Value, ApiError> {
        serde_json::from_slice(body).map_err(|e| bad(format!("body is not JSON: {e}")))
    };
    match (method.clone(), &t.name) {
        (Method::GET, None) => {
            for p in q.keys() {
                if !matches!(
                    p.as_str(),
                    "watch"
                        | "resourceVersion"
                        | "resourceVersionMatch"
                        | "labelSelector"
                        | "fieldSelector"
                        | "allowWatchBookmarks"
                        | "timeoutSeconds"
                        | "limit"
                        | "continue"
                ) {
                    return Err(bad(format!(
                        "the double does not serve query parameter {p}"
                    )));
                }
            }
            let selector = Filter::parse(
                q.get("labelSelector").map_or("", String::as_str),
                q.get("fieldSelector").map_or("", String::as_str),
                t.kind.plural,
            )
            .map_err(bad)?;
            if q.get("watch").is_some_and(|w| w == "true" || w == "1") {
                let from: u64 = match q.get("resourceVersion").map(String::as_str) {
                    None | Some("") | Some("0") => {
                        return Err(bad(
                            "the double serves watches from a resourceVersion only (list first)",
                        ));
                    }
                    Some(rv) => rv
                        .parse()
                        .map_err(|_| bad(format!("bad resourceVersion {rv}")))?,
                };
                let bookmarks = q.get("allowWatchBookmarks").is_some_and(|b| b == "true");
                let timeout = q
                    .get("timeoutSeconds")
                    .and_then(|s| s.parse().ok())
                    .map(Duration::from_secs);
                return Ok(watch(
                    shared,
                    t.kind,
                    t.namespace.clone(),
                    selector,
                    from,
                    bookmarks,
                    timeout,
                ));
            }
            let limit: usize = q
                .get("limit")
                .and_then(|l| l.parse().ok())
                .filter(|l| *l > 0)
                .unwrap_or(usize::MAX);
            // A continued list is served from the first page's snapshot,
            // as the API server serves it from that page's revision; a
            // snapshot forgotten (expired history) is 410 Expired.
            let (snapshot, offset, rv, items) = match q.get("continue") {
                Some(token) => {
                    let (id, offset) = token
                        .split_once(':')
                        .and_then(|(i, o)| Some((i.parse::<u64>().ok()?, o.parse::<usize>().ok()?)))
                        .ok_or_else(|| bad(format!("bad continue token {token:?}")))?;
                    let (rv, items) = shared.snapshot(id).ok_or_else(expired_continue)?;
                    (id, offset, rv, items)
                }
                None => {
                    let (rv, items) =
                        shared
                            .store()
                            .list(&t.kind, t.namespace.as_deref(), &selector);
                    (0, 0, rv, items)
                }
            };
            let total = items.len();
            let page: Vec<Value> = items
                .iter()
                .skip(offset)
                .take(limit)
                .cloned()
                .map(|mut v| {
                    // List items carry no kind, as the API server's.
                    if let Some(o) = v.as_object_mut() {
                        o.remove("kind");
                        o.remove("apiVersion");
                    }
                    v
                })
                .collect();
            let mut meta = json!({"resourceVersion": rv.to_string()});
            if offset + page.len() < total {
                let id = if snapshot == 0 {
                    shared.keep_snapshot(rv, items)
                } else {
                    snapshot
                };
                meta["continue"] = json!(format!("{id}:{}", offset + page.len()));
            }
            Ok(answer(
                200,
                &json!({
                    "kind": format!("{}List", t.kind.kind),
                    "apiVersion": t.kind.api_version(),
                    "metadata": meta,
                    "items": page,
                }),
            ))
        }
        (Method::GET, Some(name)) => Ok(answer(200, &shared.store().get(&t.kind, &ns, name)?)),
        (Method::POST, None) => {
            let body = json_body()?;
            let v = shared.write(|s| s.create(&t.kind, &ns, &body).map(|(v, c)| (v, Some(c))))?;
            Ok(answer(201, &v))
        }
        (Method::PUT, Some(name)) => {
            let body = json_body()?;
            let v = shared.write(|s| s.replace(&t.kind, &ns, name, &body, t.status))?;
            Ok(answer(200, &v))
        }
        (Method::PATCH, Some(name)) => {
            if content_type != Some("application/merge-patch+json") {
                return Err(ApiError {
                    code: 415,
                    reason: "UnsupportedMediaType",
                    message: format!(
                        "the double serves merge patches only, not {}",
                        content_type.unwrap_or("no content type")
                    ),
                });
            }
            let patch = json_body()?;
            let v = shared.write(|s| s.patch(&t.kind, &ns, name, &patch, t.status))?;
            Ok(answer(200, &v))
        }
        (Method::DELETE, Some(name)) => {
            let v = shared.write(|s| s.delete(&t.kind, &ns, name).map(|(v, c)| (v, Some(c))))?;
            Ok(answer(200, &v))
        }
        _ => Err(ApiError {
            code: 405,
            reason: "MethodNotAllowed",
            message: format!("{method} is not served on {}", uri.path()),
        }),
    }
}

fn line(kind: &str, object: &Value) -> Result<Bytes, Infallible> {
    let mut s = json!({"type": kind, "object": object}).to_string();
    s.push('\n');
    Ok(Bytes::from(s))
}

/// A watch: the history after `from`, then every change as it comes, a
/// bookmark every `bookmark_every` when asked; ends after `timeout`, when
/// the test breaks watches (after a `410 Gone` ERROR event when it
/// expires them), or when the client goes.
fn watch(
    shared: &Arc<Shared>,
    kind: Kind,
    ns: Option<String>,
    selector: Filter,
    from: u64,
    bookmarks: bool,
    timeout: Option<Duration>,
) -> Response {
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Bytes, Infallible>>(1024);
    // History and subscription under one lock: writers publish under it,
    // so nothing falls between them.
    let (backlog, mut live, mut last, mut cut) = {
        let store = shared.store();
        let backlog = store.since(&kind, ns.as_deref(), &selector, from);
        (
            backlog,
            shared.tx.subscribe(),
            store.rv(),
            shared.cut.subscribe(),
        )
    };
    let every = shared.bookmark_every;
    let of = super::WatchOf {
        plural: kind.plural,
        one: selector
            .fields
            .iter()
            .any(|(path, equal, _)| path == "metadata.name" && *equal),
    };
    let s2 = shared.clone();
    tokio::spawn(async move {
        let _count = s2.open_watch(of);
        let backlog = match backlog {
            Ok(b) => b,
            Err(e) => {
                let _ = tx.send(line("ERROR", &e.status())).await;
                return;
            }
        };
        for c in backlog {
            if tx.send(line(c.kind.as_str(), &c.object)).await.is_err() {
                return;
            }
        }
        let deadline = timeout.map(|t| tokio::time::Instant::now() + t);
        let mut tick = tokio::time::interval(every);
        tick.tick().await;
        loop {
            let sleep_until = async {
                match deadline {
                    Some(d) => tokio::time::sleep_until(d).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                got = live.recv() => match got {
                    Ok(c) => {
                        last = last.max(c.rv);
                        if let Some(t) = seen_as(&kind, ns.as_deref(), &selector, &c)
                            && tx.send(line(t.as_str(), &c.object)).await.is_err()
                        {
                            return;
                        }
                    }
                    // A watcher too slow to keep up is closed, as the API
                    // server closes it; the client watches again.
                    Err(_) => return,
                },
                _ = tick.tick(), if bookmarks => {
                    let bm = json!({
                        "kind": kind.kind, "apiVersion": kind.api_version(),
                        "metadata": {"resourceVersion": last.to_string()},
                    });
                    if tx.send(line("BOOKMARK", &bm)).await.is_err() {
                        return;
                    }
                }
                changed = cut.changed() => {
                    if changed.is_ok() && *cut.borrow() == super::Cut::Expire {
                        let gone = ApiError {
                            code: 410,
                            reason: "Expired",
                            message: format!("too old resource version: {last}"),
                        };
                        let _ = tx.send(line("ERROR", &gone.status())).await;
                    }
                    return;
                }
                () = sleep_until => return,
                () = tx.closed() => return,
            }
        }
    });
    let stream =
        futures::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|b| (b, rx)) });
    Response::builder()
        .status(200)
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from_stream(stream))
        .expect("response")
}
