"""A 3-turn environment for the vLLM agent test, in the char tokenizer's alphabet (digits
and + - * = space): each turn gets the next countdown number as a tool message."""


class Countdown:
    def reset(self, row):
        self.left = 3
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, assistant_message):
        self.left -= 1
        done = self.left == 0
        return ([] if done else [{"role": "tool", "content": str(self.left) * 2}]), float(done), done, {}
