fn main() {
    eprintln!("modelrelay-worker: not built yet");
    std::process::exit(2);
}
