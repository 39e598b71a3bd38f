"""JAGG Studio's Gradio app: the page (:mod:`app.ui`), the form and run config (:mod:`app.form`), training job
control (:mod:`app.jobs`) and the live view's run-directory readers (:mod:`app.live`). Training logic lives in
:mod:`jagg_core`; the app only launches ``accelerate launch -m jagg_core.run`` and reads the run directory."""
