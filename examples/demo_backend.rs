//! A demo OpenAI-compatible backend for `make run`: answers every chat request with a
//! fixed sentence, streamed word by word when asked. `DEMO_BACKEND_ADDR` sets the
//! address (default 127.0.0.1:8000), `DEMO_MODEL` the model name (default `demo`).

#[path = "support/fake_backend.rs"]
mod fake_backend;

fn main() {
    let addr = std::env::var("DEMO_BACKEND_ADDR").unwrap_or_else(|_| "127.0.0.1:8000".into());
    let model = std::env::var("DEMO_MODEL").unwrap_or_else(|_| "demo".into());
    let answer = "Hello from the modelrelay demo backend! Your request went client to relay to worker to backend and back.";
    match fake_backend::FakeBackend::new(&model, answer).spawn(&addr) {
        Ok(bound) => println!("demo backend serving model `{model}` on http://{bound}"),
        Err(e) => {
            eprintln!("demo backend: cannot listen on {addr}: {e}");
            std::process::exit(1);
        }
    }
    loop {
        std::thread::park();
    }
}
