"""Stand-ins and recorders the tests share (not tests themselves)."""
