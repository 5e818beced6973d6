"""planaria-custom-script: a health check for any chip, written as the user's own executable."""

from planaria_custom_script.check import CustomScriptCheck
from planaria_custom_script.options import CustomScriptOptions

__all__ = ["CustomScriptCheck", "CustomScriptOptions"]
