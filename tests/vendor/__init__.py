"""Third-party models vendored unchanged for jzero's tests (each with its licence and SOURCE.md)."""
