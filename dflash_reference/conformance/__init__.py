"""The conformance kit."""
