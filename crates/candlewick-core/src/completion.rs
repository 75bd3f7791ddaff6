//! Submissions and their completion handles.

/// A handle on the work of exactly one submission.
pub trait Completion {
    /// The backend's error type.
    type Error;
    /// Whether the submission's work has finished, without blocking.
    fn is_complete(&self) -> Result<bool, Self::Error>;
    /// Blocks until the submission's work has finished.
    fn wait(self) -> Result<(), Self::Error>;
}

/// An output together with the completion that makes it safe to read.
#[derive(Debug)]
pub struct Submission<T, C> {
    /// The submission's output; its values are only final once `completion` is.
    pub output: T,
    /// The handle on this submission's work.
    pub completion: C,
}

impl<T, C: Completion> Submission<T, C> {
    /// Pairs an output with its completion.
    pub fn new(output: T, completion: C) -> Self {
        Self { output, completion }
    }

    /// Waits for the work and hands back the output.
    pub fn wait(self) -> Result<T, C::Error> {
        self.completion.wait()?;
        Ok(self.output)
    }
}

/// A completion for work that finished before it was returned (synchronous backends).
#[derive(Debug, Clone, Copy, Default)]
pub struct ReadyCompletion<E> {
    _error: std::marker::PhantomData<fn() -> E>,
}

impl<E> ReadyCompletion<E> {
    /// A completion that is already complete.
    pub fn new() -> Self {
        Self { _error: std::marker::PhantomData }
    }
}

impl<E> Completion for ReadyCompletion<E> {
    type Error = E;
    fn is_complete(&self) -> Result<bool, E> {
        Ok(true)
    }
    fn wait(self) -> Result<(), E> {
        Ok(())
    }
}
