"""dspark.runtime: loads a .dsmodel bundle and runs it (bundle reader, executor, caches)."""

from dspark.runtime.version import BUNDLE_FORMAT_VERSION, __version__

__all__ = ["BUNDLE_FORMAT_VERSION", "__version__"]
