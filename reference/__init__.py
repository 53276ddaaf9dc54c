"""The algorithm and the op contracts in code: literal, loop-based reference implementations (the test oracle)."""
