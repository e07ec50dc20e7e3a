"""Training an EAGLE draft head against a target model (`pdserve train-eagle`)."""
