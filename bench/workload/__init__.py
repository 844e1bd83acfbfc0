"""What a hit is worth: serving traces replayed through real LMCache engines, beside the simulated policies."""
