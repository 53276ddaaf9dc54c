"""The specification in code: literal, loop-based reference implementations (the test oracle)."""
