"""JAGG Studio: ``python app.py`` serves the page on $GRADIO_SERVER_PORT (default 7860). Also the Space entry."""

from app.ui import launch

if __name__ == "__main__":
    launch()
