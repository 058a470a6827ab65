"""Training a drafter."""
