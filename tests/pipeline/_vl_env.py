"""A picture-sending environment for the VL agent test (``test_vision_language_modes.py``):
the first turn is told to wait; whatever it says, the environment answers with the row's
picture (drawn from the row, so every episode of a group sees the same one) and its
question; the second turn's answer ends the episode (reward: exact answer). Loaded by path
in the env workers: its top level imports nothing heavy."""


class PictureEnv:
    def reset(self, row: dict) -> list[dict]:
        self.row, self.turn = row, 0
        return [{"role": "user", "content": "A picture follows."}]

    def step(self, text: str):
        self.turn += 1
        if self.turn == 1:
            import hashlib
            import random

            from hybridrl.data.shapes import draw_board

            rng = random.Random(int(hashlib.sha256(str(self.row["prompt"]).encode()).hexdigest()[:8], 16))
            picture = draw_board(rng, ["red", "blue"][: 1 + rng.randrange(2)], cells=4, cell=28)
            return ([{"role": "user", "content": [{"type": "image", "image": picture},
                                                  {"type": "text", "text": str(self.row["prompt"])}]}], 0.0, False, {})
        return [], float(text.strip() == str(self.row["answer"])), True, {}
