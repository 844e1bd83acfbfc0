"""What several test files share that is not a fixture: raw-protocol peers' building blocks."""
