"""What a caller asks for (requests, sampling) and the state of one sequence."""
