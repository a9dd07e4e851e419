//! Sleep when idle: after `IDLE_SUSPEND_SECS` without a request the worker asks its
//! relay (`sleep_request`); granted, it finishes what it has, disconnects and runs
//! `SUSPEND_CMD`. The connection loop holds meanwhile ([`Sleep::hold`]). The machine
//! resuming shows as the wall clock jumping ahead of the monotonic clock (which stops
//! while suspended): then the worker reconnects at once, and a session that was open
//! across a suspend nobody asked for is dropped at once rather than after three
//! silent ping intervals.

use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use crossbeam_channel::{Receiver, Sender};
use log::{info, warn};
use parking_lot::{Condvar, Mutex};

use crate::protocol::WorkerMessage;
use crate::worker::Shared;
use crate::ws::close_code;

/// How often the idle time and the clocks are looked at.
const TICK: Duration = Duration::from_secs(1);
/// Wall time beyond monotonic time that means the machine was suspended.
const JUMP: Duration = Duration::from_secs(3);
/// How long the relay has to answer a `sleep_request`.
const ANSWER_WAIT: Duration = Duration::from_secs(10);
/// A suspend command that returned but the machine never slept: reconnect after this.
const RESUME_GRACE: Duration = Duration::from_secs(120);

/// The relay's `sleep_answer`: granted, and why not.
type Answer = (bool, Option<String>);

/// Whether the worker holds its connection because the box is (going) asleep, and the
/// relay's answers to `sleep_request`.
pub struct Sleep {
    asleep: Mutex<bool>,
    woke: Condvar,
    /// Set on resume: the next reconnection goes at once.
    resumed: Mutex<bool>,
    last_request: Mutex<Instant>,
    answers: (Sender<Answer>, Receiver<Answer>),
}

impl Default for Sleep {
    fn default() -> Sleep {
        Sleep {
            asleep: Mutex::new(false),
            woke: Condvar::new(),
            resumed: Mutex::new(false),
            last_request: Mutex::new(Instant::now()),
            answers: crossbeam_channel::bounded(4),
        }
    }
}

impl Sleep {
    /// A request arrived: the idle time starts again.
    pub fn touch(&self) {
        *self.last_request.lock() = Instant::now();
    }

    /// The relay's `sleep_answer`.
    pub fn answered(&self, granted: bool, reason: Option<String>) {
        let _ = self.answers.0.try_send((granted, reason));
    }

    /// Called by the connection loop after a session ended: blocks while the box is
    /// asleep. Returns true when it should reconnect at once (it just woke).
    pub fn hold(&self) -> bool {
        let mut asleep = self.asleep.lock();
        while *asleep {
            self.woke.wait(&mut asleep);
        }
        drop(asleep);
        std::mem::take(&mut *self.resumed.lock())
    }

    fn set_asleep(&self, value: bool) {
        *self.asleep.lock() = value;
        if !value {
            self.woke.notify_all();
        }
    }
}

/// Whether the wall clock moved `JUMP` further than the monotonic clock did.
pub fn jumped(mono: Duration, wall: Duration) -> bool {
    wall.saturating_sub(mono) > JUMP
}

/// Watches the clocks, and with `IDLE_SUSPEND_SECS` the idle time. Runs until drain.
pub fn run(shared: &Arc<Shared>) {
    let cfg = &shared.cfg.power;
    let sleep = &shared.power.sleep;
    let mut last = (Instant::now(), SystemTime::now());
    let mut suspended_at: Option<Instant> = None;
    loop {
        if shared.wait_for_drain(TICK) {
            sleep.set_asleep(false);
            return;
        }
        let now = (Instant::now(), SystemTime::now());
        let mono = now.0.saturating_duration_since(last.0);
        let wall = now.1.duration_since(last.1).unwrap_or_default();
        last = now;
        if jumped(mono, wall) {
            info!(
                "the machine was asleep for about {}s; reconnecting now",
                wall.saturating_sub(mono).as_secs()
            );
            resume(shared);
            suspended_at = None;
            continue;
        }
        if let Some(at) = suspended_at {
            if at.elapsed() >= RESUME_GRACE {
                warn!("SUSPEND_CMD returned but the machine did not sleep; reconnecting");
                resume(shared);
                suspended_at = None;
            }
            continue;
        }
        let Some(idle_limit) = cfg.idle_suspend else {
            continue;
        };
        let owner_busy = shared
            .power
            .owner_busy
            .load(std::sync::atomic::Ordering::Acquire);
        if cfg.stay_awake || owner_busy || !shared.inflight.is_empty() {
            sleep.touch();
            continue;
        }
        if sleep.last_request.lock().elapsed() < idle_limit {
            continue;
        }
        if ask_and_suspend(shared, idle_limit) {
            suspended_at = Some(Instant::now());
            last = (Instant::now(), SystemTime::now());
        }
    }
}

/// The box woke (or never slept): let the connection loop go, at once; drop a session
/// that was open across the suspend.
fn resume(shared: &Shared) {
    let sleep = &shared.power.sleep;
    *sleep.resumed.lock() = true;
    sleep.touch();
    sleep.set_asleep(false);
    for link in shared.relays.links() {
        link.out
            .close(close_code::GOING_AWAY, "worker resumed from sleep");
    }
}

/// Asks the relay; granted, drains, disconnects and runs `SUSPEND_CMD`. True when the
/// command ran (the worker now waits for the machine to resume).
fn ask_and_suspend(shared: &Shared, idle: Duration) -> bool {
    let sleep = &shared.power.sleep;
    // Without a relay that understands the request, or a wake address, nobody could
    // wake the box again: it stays up.
    // With several relays, every one must understand and grant it: a relay that could
    // not would go on sending work to a box that is asleep.
    let links = shared.relays.links();
    if links.is_empty() || links.iter().any(|l| !l.sleep) {
        sleep.touch();
        return false;
    }
    while sleep.answers.1.try_recv().is_ok() {}
    let whom = if links.len() == 1 {
        "the relay"
    } else {
        "every relay"
    };
    info!("idle for {}s: asking {whom} to sleep", idle.as_secs());
    for link in &links {
        link.out.send(&WorkerMessage::SleepRequest {});
    }
    let deadline = Instant::now() + ANSWER_WAIT;
    let mut refusal = None;
    for _ in &links {
        match sleep.answers.1.recv_deadline(deadline) {
            Ok((true, _)) => {}
            Ok((false, reason)) => {
                refusal = Some(reason.unwrap_or_else(|| "no reason given".into()))
            }
            Err(_) => refusal = Some("a relay did not answer the sleep request".into()),
        }
    }
    if let Some(reason) = refusal {
        info!("staying awake: {reason}");
        sleep.touch();
        // A relay that granted sends this box nothing new: a fresh session undoes that.
        if links.len() > 1 {
            for link in &links {
                link.out
                    .close(close_code::GOING_AWAY, "sleep refused elsewhere");
            }
        }
        return false;
    }
    sleep.set_asleep(true);
    // The relay sends nothing new now; what is in flight finishes first.
    if !shared
        .inflight
        .wait_idle(Instant::now() + shared.cfg.drain_timeout)
    {
        shared.inflight.cancel_all();
    }
    for link in &links {
        link.out.close(close_code::NORMAL, "worker going to sleep");
    }
    let Some(cmd) = shared.cfg.power.suspend_cmd.as_deref() else {
        return true;
    };
    info!("going to sleep: running SUSPEND_CMD");
    match Command::new("sh").arg("-c").arg(cmd).status() {
        Ok(status) if status.success() => true,
        Ok(status) => {
            warn!("SUSPEND_CMD failed ({status}); staying awake");
            resume(shared);
            false
        }
        Err(e) => {
            warn!("cannot run SUSPEND_CMD: {e}; staying awake");
            resume(shared);
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_wall_time_well_ahead_of_monotonic_time_is_a_resume() {
        let s = Duration::from_secs;
        assert!(!jumped(s(1), s(1)));
        assert!(
            !jumped(s(1), s(3)),
            "NTP slews and scheduling hiccups are small"
        );
        assert!(jumped(s(1), s(3600)));
        // A wall clock set back is no resume.
        assert!(!jumped(s(5), s(0)));
    }

    #[test]
    fn the_connection_loop_is_held_while_asleep_and_released_on_resume() {
        let sleep = Arc::new(Sleep::default());
        assert!(!sleep.hold(), "awake: no hold, no hurry");
        sleep.set_asleep(true);
        let (tx, rx) = crossbeam_channel::bounded(1);
        let held = sleep.clone();
        std::thread::spawn(move || {
            let _ = tx.send(held.hold());
        });
        assert!(rx.recv_timeout(Duration::from_millis(100)).is_err());
        *sleep.resumed.lock() = true;
        sleep.set_asleep(false);
        assert_eq!(rx.recv_timeout(Duration::from_secs(5)), Ok(true));
    }
}
