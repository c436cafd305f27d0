"""Scale-out on Ray Serve: many engine replicas of one bundle behind one OpenAI endpoint."""
