"""A tools class whose tool returns a picture (loaded by path in env workers)."""


class Painter:
    def draw(self, colour: str):
        """Draw one shape.

        Args:
            colour: red, green, blue or yellow
        """
        import random

        from hybridrl.data.shapes import draw_board

        return draw_board(random.Random(0), [colour], cells=4, cell=28)

    def caption(self, colour: str) -> list:
        """A picture with a caption.

        Args:
            colour: red, green, blue or yellow
        """
        return [self.draw(colour), f"a {colour} shape"]
