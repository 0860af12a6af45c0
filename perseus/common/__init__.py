"""Framework-neutral public API shared by every perseus framework module."""
