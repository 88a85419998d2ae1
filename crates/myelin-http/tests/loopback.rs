//! Server and client pool against each other over real loopback sockets: HTTP/1.1 keep-alive,
//! h2c, streaming bodies, client disconnects and graceful shutdown.

use std::cell::Cell;
use std::rc::Rc;
use std::time::Duration;

use bytes::Bytes;
use glommio::LocalExecutorBuilder;
use glommio::net::{TcpListener, TcpStream};
use glommio::timer::Timer;
use http::{Request, Response, StatusCode};
use http_body_util::BodyExt;
use myelin_http::body::{self, Body};
use myelin_http::client::{Pool, PoolConfig};
use myelin_http::executor::DEFAULT_IO_MEMORY_BYTES;
use myelin_http::io::GlommioIo;
use myelin_http::rt::LocalExec;
use myelin_http::server::{ServerConfig, Shutdown, serve};

fn run<F: std::future::Future<Output = ()> + 'static>(test: impl FnOnce() -> F) {
    LocalExecutorBuilder::default()
        .io_memory(DEFAULT_IO_MEMORY_BYTES)
        .make()
        .expect("executor")
        .run(test());
}

/// Test server state observed by the assertions.
#[derive(Default)]
struct Observed {
    stream_sender_saw_close: Cell<bool>,
}

fn start_server(
    config: ServerConfig,
) -> (
    String,
    Shutdown,
    Rc<Observed>,
    glommio::Task<myelin_http::server::ServeReport>,
) {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let base = format!("http://{}", listener.local_addr().expect("addr"));
    let shutdown = Shutdown::new();
    let observed = Rc::new(Observed::default());
    let seen = observed.clone();
    let handler = move |request: Request<hyper::body::Incoming>| {
        let seen = seen.clone();
        async move {
            match request.uri().path() {
                "/echo" => {
                    let bytes = request
                        .into_body()
                        .collect()
                        .await
                        .map(|b| b.to_bytes())
                        .unwrap_or_default();
                    Response::new(body::full(bytes))
                }
                "/slow" => {
                    Timer::new(Duration::from_millis(200)).await;
                    Response::new(body::full("slow done"))
                }
                "/stream" => {
                    let (sender, stream_body) = body::channel(1);
                    glommio::spawn_local(async move {
                        for index in 0..1000 {
                            if sender.send(format!("data: {index}\n\n")).await.is_err() {
                                seen.stream_sender_saw_close.set(true);
                                return;
                            }
                            Timer::new(Duration::from_millis(2)).await;
                        }
                    })
                    .detach();
                    Response::new(stream_body)
                }
                _ => Response::builder()
                    .status(StatusCode::NOT_FOUND)
                    .body(body::empty())
                    .expect("response"),
            }
        }
    };
    let task = glommio::spawn_local(serve(listener, handler, config, shutdown.clone()));
    (base, shutdown, observed, task)
}

fn post(uri: String, payload: &'static str) -> Request<Body> {
    Request::post(uri)
        .body(body::full(payload))
        .expect("request")
}

#[test]
fn http1_keep_alive_reuses_one_connection() {
    run(|| async {
        let (base, shutdown, _, task) = start_server(ServerConfig::default());
        let pool = Pool::new(PoolConfig::default());
        for payload in ["first", "second", "third"] {
            let response = pool
                .send(post(format!("{base}/echo"), payload))
                .await
                .expect("send");
            assert_eq!(response.status(), StatusCode::OK);
            let bytes = response
                .into_body()
                .collect()
                .await
                .expect("body")
                .to_bytes();
            assert_eq!(bytes, Bytes::from(payload));
        }
        let authority = base
            .trim_start_matches("http://")
            .parse()
            .expect("authority");
        assert_eq!(pool.pooled_connections(&authority), 1);
        shutdown.trigger();
        let report = task.await;
        assert_eq!(report.accepted, 1);
        assert_eq!(report.abandoned, 0);
    });
}

#[test]
fn streaming_chunks_arrive_in_order_and_disconnect_reaches_producer() {
    run(|| async {
        let (base, shutdown, observed, task) = start_server(ServerConfig::default());
        let pool = Pool::new(PoolConfig::default());
        let response = pool
            .send(
                Request::get(format!("{base}/stream"))
                    .body(body::empty())
                    .expect("request"),
            )
            .await
            .expect("send");
        let mut incoming = response.into_body();
        let mut parser = myelin_http::sse::SseParser::new();
        let mut seen = Vec::new();
        while seen.len() < 5 {
            let frame = incoming.frame().await.expect("frame").expect("ok frame");
            if let Ok(data) = frame.into_data() {
                seen.extend(parser.feed(&data).into_iter().map(|event| event.data));
            }
        }
        assert_eq!(&seen[..5], ["0", "1", "2", "3", "4"]);
        drop(incoming);
        for _ in 0..200 {
            if observed.stream_sender_saw_close.get() {
                break;
            }
            Timer::new(Duration::from_millis(5)).await;
        }
        assert!(
            observed.stream_sender_saw_close.get(),
            "producer never learned the client left"
        );
        shutdown.trigger();
        task.await;
    });
}

#[test]
fn h2c_prior_knowledge_is_served() {
    run(|| async {
        let (base, shutdown, _, task) = start_server(ServerConfig::default());
        let (mut sender, _) = h2_connection(&base).await;
        let request = Request::post(format!("{base}/echo"))
            .body(body::full("over h2"))
            .expect("request");
        let response = sender.send_request(request).await.expect("h2 response");
        assert_eq!(response.version(), http::Version::HTTP_2);
        let bytes = response
            .into_body()
            .collect()
            .await
            .expect("body")
            .to_bytes();
        assert_eq!(bytes, Bytes::from("over h2"));
        drop(sender);
        shutdown.trigger();
        task.await;
    });
}

#[test]
fn graceful_shutdown_finishes_in_flight_requests_then_refuses() {
    run(|| async {
        let (base, shutdown, _, task) = start_server(ServerConfig::default());
        let pool = Rc::new(Pool::new(PoolConfig::default()));
        let slow_pool = pool.clone();
        let slow_uri = format!("{base}/slow");
        let in_flight = glommio::spawn_local(async move {
            let response = slow_pool
                .send(Request::get(slow_uri).body(body::empty()).expect("request"))
                .await
                .expect("in-flight request is served");
            response
                .into_body()
                .collect()
                .await
                .expect("body")
                .to_bytes()
        });
        Timer::new(Duration::from_millis(50)).await;
        shutdown.trigger();
        assert_eq!(in_flight.await, Bytes::from("slow done"));
        let report = task.await;
        assert_eq!(report.abandoned, 0);
        let refused = Pool::new(PoolConfig::default())
            .send(
                Request::get(format!("{base}/echo"))
                    .body(body::empty())
                    .expect("request"),
            )
            .await;
        assert!(
            refused.as_ref().is_err_and(|error| error.is_connect()),
            "{refused:?}"
        );
    });
}

#[test]
fn connect_error_is_marked_retryable() {
    run(|| async {
        // Bind then drop to find a port nobody listens on.
        let port = TcpListener::bind("127.0.0.1:0")
            .expect("bind")
            .local_addr()
            .expect("addr")
            .port();
        let error = Pool::new(PoolConfig::default())
            .send(
                Request::get(format!("http://127.0.0.1:{port}/"))
                    .body(body::empty())
                    .expect("request"),
            )
            .await
            .expect_err("nobody listens");
        assert!(error.is_connect(), "{error}");
    });
}

/// Opens an h2c connection to `base` and returns its sender and a flag set when the
/// connection task ends (the server closed it).
async fn h2_connection(
    base: &str,
) -> (
    hyper::client::conn::http2::SendRequest<Body>,
    Rc<Cell<bool>>,
) {
    let addr = base.trim_start_matches("http://").to_string();
    let stream = TcpStream::connect(addr.as_str()).await.expect("connect");
    let (sender, connection) =
        hyper::client::conn::http2::handshake(LocalExec, GlommioIo::new(stream))
            .await
            .expect("h2 handshake");
    let closed = Rc::new(Cell::new(false));
    let flag = closed.clone();
    glommio::spawn_local(async move {
        let _ = connection.await;
        flag.set(true);
    })
    .detach();
    (sender, closed)
}

/// Polls `condition` every 10 ms for up to 10 s.
async fn eventually(condition: impl Fn() -> bool) -> bool {
    for _ in 0..1000 {
        if condition() {
            return true;
        }
        Timer::new(Duration::from_millis(10)).await;
    }
    false
}

#[test]
fn an_idle_h2_connection_is_closed_but_not_while_a_stream_runs() {
    run(|| async {
        let config = ServerConfig {
            h2_idle_timeout: Duration::from_millis(300),
            ..ServerConfig::default()
        };
        let (base, shutdown, _, task) = start_server(config);
        // A stream that lasts longer than the idle timeout keeps its connection open.
        let (mut sender, closed) = h2_connection(&base).await;
        let request = Request::get(format!("{base}/stream"))
            .body(body::empty())
            .expect("request");
        let response = sender.send_request(request).await.expect("h2 response");
        let mut body = response.into_body();
        let mut frames = 0;
        while let Some(frame) = body.frame().await {
            frame.expect("frame");
            frames += 1;
            if frames == 300 {
                break; // about 600 ms of streaming
            }
        }
        assert!(!closed.get(), "closed while a stream was answered");
        drop(body);
        // Idle: closed by the server within the timeout (and a bounded wait).
        assert!(
            eventually(|| closed.get()).await,
            "idle h2 connection left open"
        );
        shutdown.trigger();
        task.await;
    });
}

#[test]
fn connections_past_the_cap_are_closed_on_accept_and_counted() {
    run(|| async {
        let config = ServerConfig {
            max_connections: 2,
            ..ServerConfig::default()
        };
        let (base, shutdown, _, task) = start_server(config);
        let (_first, first_closed) = h2_connection(&base).await;
        let (_second, second_closed) = h2_connection(&base).await;
        // The third is accepted and closed at once: its handshake fails or it ends.
        let addr = base.trim_start_matches("http://").to_string();
        let stream = TcpStream::connect(addr.as_str()).await.expect("connect");
        let third =
            hyper::client::conn::http2::handshake::<_, _, Body>(LocalExec, GlommioIo::new(stream))
                .await;
        if let Ok((mut sender, connection)) = third {
            glommio::spawn_local(async move {
                let _ = connection.await;
            })
            .detach();
            let request = Request::post(format!("{base}/echo"))
                .body(body::full("x"))
                .expect("request");
            assert!(sender.send_request(request).await.is_err());
        }
        assert!(!first_closed.get() && !second_closed.get());
        shutdown.trigger();
        let report = task.await;
        assert_eq!(report.refused, 1);
        assert_eq!(report.accepted, 3);
    });
}
