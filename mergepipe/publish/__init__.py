"""Publishing: the manifest and digest, verification, input checks before publishing, and reports on finished outputs."""
