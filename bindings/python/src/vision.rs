//! Images for Python (issue 39, docs/vision.md): `ModelRuntime.process`, the ids and pixel values
//! a call with images runs on. The calls themselves take `images=` / `pixel_values=` in their
//! own files, through the helpers of `runtime` (`image_call`, `stage`).

use numpy::ndarray::{ArrayD, IxDyn};
use numpy::PyArray;
use pyo3::prelude::*;
use pyo3::types::PyAny;

use super::errors::InternalError;
use super::runtime::PyModelRuntime;

#[pymethods]
impl PyModelRuntime {
    /// What a call with images runs on: the prompt's token ids with each image's tokens laid out
    /// as the model's processor lays them out, and the processed images.
    ///
    /// Args:
    ///     prompt (str | Sequence[int] | list[dict]): text or ids (each image placeholder, such
    ///         as Gemma 3's ``<start_of_image>``, expanded; a prompt with none gets one per image
    ///         in front), or chat messages whose image parts the chat template places.
    ///     images (list | None): paths, bytes, data: URLs, PIL images or HxWxC uint8 arrays; with
    ///         chat messages, None takes the messages' own image parts.
    ///     chat_template (str | None): with chat messages, a template instead of the model's.
    ///
    /// Returns:
    ///     tuple[list[int], numpy.ndarray]: the ids and float32 pixel values ``[n, 3, S, S]``,
    ///     which ``prefill``, ``trace`` and ``generate`` take as ``(ids, pixel_values=...)``.
    ///
    /// Raises:
    ///     ImageError: an image that cannot be read, or placeholders that do not match the images.
    ///     CandlewickError: a model that takes no images.
    ///
    /// Example:
    ///     >>> ids, pixels = rt.process("Describe it.", ["cat.png"])
    ///     >>> rt.generate(ids, pixel_values=pixels, max_tokens=32).text
    #[pyo3(signature = (prompt, images=None, *, chat_template=None))]
    fn process<'py>(
        &self,
        py: Python<'py>,
        prompt: &Bound<'py, PyAny>,
        images: Option<&Bound<'py, PyAny>>,
        chat_template: Option<&str>,
    ) -> PyResult<(Vec<u32>, Bound<'py, PyArray<f32, IxDyn>>)> {
        let chat = prompt.is_instance_of::<pyo3::types::PyList>()
            && prompt.len()? > 0
            && prompt.get_item(0)?.is_instance_of::<pyo3::types::PyDict>();
        let call = if chat {
            self.chat_image_call(py, prompt, chat_template, images)?
        } else {
            let images = match images {
                Some(i) => i.clone(),
                None => pyo3::types::PyList::empty(py).into_any(),
            };
            self.image_call(py, prompt, Some(&images), None)?
        };
        let call = call.ok_or_else(|| super::errors::invalid_option(py, "process: no images given".into()))?;
        let pixels = ArrayD::from_shape_vec(IxDyn(&call.pixels.shape), call.pixels.data)
            .map_err(|e| InternalError::new_err(e.to_string()))?;
        Ok((call.ids, PyArray::from_owned_array(py, pixels)))
    }
}
