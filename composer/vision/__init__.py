"""Vision: image preprocessing, the vision tower and its positions for vision-language models.

Import the modules themselves (``composer.vision.preprocess``); this package imports nothing.
"""
