"""Images in the prompt: decoding and hashing (``image.py``), the model's preprocessing
(``processor.py``), the vision tower and projector (``encoder.py``) and their weights
(``loader.py``)."""
