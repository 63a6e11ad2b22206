"""Training: our GPT (model), corpora (data), key-spectrum control (interventions), the training loop
(loop) and sweeps over it (sweep). Imports the ground floor and probing."""
