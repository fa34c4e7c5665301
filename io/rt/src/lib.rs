//! hyper's runtime hooks, spawning and sleeping through the `tokio` this build names.
//!
//! hyper-util's `TokioExecutor` and `TokioTimer` call the real tokio directly, which has no
//! runtime in a madsim build (the shell-sim sweep): every connection task and header timeout
//! would panic there. These two go through the workspace's `tokio` dependency instead, which is
//! tokio itself in a normal build (so they behave exactly as hyper-util's) and madsim's
//! deterministic runtime under `--cfg madsim`. The server's connections and the worker's HTTP
//! client both use them, so the sweep runs the same code as production.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

/// Runs hyper's background futures (a pooled connection's driver) as tasks.
#[derive(Clone, Copy, Debug, Default)]
pub struct Exec;

impl<F> hyper::rt::Executor<F> for Exec
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    fn execute(&self, fut: F) {
        tokio::spawn(fut);
    }
}

/// hyper's timer (header read timeouts, the idle pool's expiry) on `tokio::time`.
#[derive(Clone, Copy, Debug, Default)]
pub struct Timer;

impl hyper::rt::Timer for Timer {
    fn sleep(&self, duration: Duration) -> Pin<Box<dyn hyper::rt::Sleep>> {
        Box::pin(Sleep(Box::pin(tokio::time::sleep(duration))))
    }

    // tokio's `Instant` is a wrapper of std's; madsim's is std's own, so `into` is needed in
    // one build and an identity in the other.
    #[allow(clippy::useless_conversion)]
    fn sleep_until(&self, deadline: Instant) -> Pin<Box<dyn hyper::rt::Sleep>> {
        Box::pin(Sleep(Box::pin(tokio::time::sleep_until(deadline.into()))))
    }
}

struct Sleep(Pin<Box<tokio::time::Sleep>>);

impl Future for Sleep {
    type Output = ();
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        self.0.as_mut().poll(cx)
    }
}

impl hyper::rt::Sleep for Sleep {}

#[cfg(test)]
mod tests {
    use super::*;
    use hyper::rt::Timer as _;

    /// The timer sleeps on tokio's clock: with time paused, a 30 s sleep ends exactly when the
    /// clock reaches it, not before.
    #[tokio::test(start_paused = true)]
    async fn the_timer_sleeps_on_tokios_clock() {
        let start = tokio::time::Instant::now();
        let mut sleep = Timer.sleep(Duration::from_secs(30));
        tokio::time::advance(Duration::from_secs(29)).await;
        assert!(futures_poll(&mut sleep).is_pending());
        Timer
            .sleep_until((start + Duration::from_secs(31)).into_std())
            .await;
        assert!(futures_poll(&mut sleep).is_ready());
    }

    /// The executor runs what it is given as a task of the current runtime.
    #[tokio::test]
    async fn the_executor_spawns_on_the_current_runtime() {
        use hyper::rt::Executor as _;
        let (tx, rx) = tokio::sync::oneshot::channel();
        Exec.execute(async move { tx.send(7).unwrap() });
        assert_eq!(rx.await.unwrap(), 7);
    }

    fn futures_poll(s: &mut Pin<Box<dyn hyper::rt::Sleep>>) -> Poll<()> {
        let waker = std::task::Waker::noop();
        s.as_mut().poll(&mut Context::from_waker(waker))
    }
}
