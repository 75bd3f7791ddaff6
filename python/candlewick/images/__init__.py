"""Images for vision-language models: reading them (`load_image`), the families' processors equal
to transformers' (`processor_for`), and chat messages with image parts (`messages_with_images`).

docs/images.md lists the families, the config keys each reads, and why transformers' torchvision
("fast") processors are the reference.
"""

from ._load import MAX_IMAGE_PIXELS, ImageError, load_image
from ._messages import messages_with_images
from ._processors import PROCESSORS, ImageProcessor, ProcessedImages, processor_for, smart_resize

__all__ = [
    "ImageError",
    "ImageProcessor",
    "MAX_IMAGE_PIXELS",
    "PROCESSORS",
    "ProcessedImages",
    "load_image",
    "messages_with_images",
    "processor_for",
    "smart_resize",
]
