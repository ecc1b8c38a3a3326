/**
 * The status bar item: "GPU 1: 2.1/4.0 GiB", and a short state word when
 * there is news ("· bursting", "· moving in 23 s"); the tooltip has the rest.
 * The `statusItem: "full"` setting makes it "GPU 1 (T4): 2.1/4.0/8.0 GiB ·
 * guaranteed".
 * It is a focusable button; Enter, Space or a click open the details panel.
 */
import { h, VirtualDOM } from '@lumino/virtualdom';
import { Widget } from '@lumino/widgets';

import { GpuFracModel } from './model';
import { StatusItemMode } from './settings';
import { statusDescription, statusLabel } from './statusText';

export class GpuStatusItem extends Widget {
  constructor(
    private readonly _model: GpuFracModel,
    private readonly _open: () => void
  ) {
    super();
    this.addClass('jp-gpufrac-StatusItem');
    this.node.tabIndex = 0;
    this.node.setAttribute('role', 'button');
    this.node.addEventListener('click', this._onClick);
    this.node.addEventListener('keydown', this._onKeyDown);
    _model.changed.connect(this._render, this);
    this._render();
  }

  /** Compact or full; follows the `statusItem` setting. */
  get mode(): StatusItemMode {
    return this._mode;
  }

  set mode(mode: StatusItemMode) {
    if (mode !== this._mode) {
      this._mode = mode;
      this._render();
    }
  }

  dispose(): void {
    if (this.isDisposed) {
      return;
    }
    this._model.changed.disconnect(this._render, this);
    this.node.removeEventListener('click', this._onClick);
    this.node.removeEventListener('keydown', this._onKeyDown);
    super.dispose();
  }

  private _onClick = (event: MouseEvent): void => {
    event.preventDefault();
    this._open();
  };

  private _onKeyDown = (event: KeyboardEvent): void => {
    if (event.key === 'Enter' || event.key === ' ') {
      // Space would otherwise scroll the page.
      event.preventDefault();
      event.stopPropagation();
      this._open();
    }
  };

  private _render(): void {
    const status = this._model.status;
    const view = this._model.view();
    const trans = this._model.trans;
    const label = statusLabel(status, view, this._mode, trans);
    const description = statusDescription(
      status,
      view,
      this._model.configProblems,
      trans
    );
    const node = this.node;
    node.dataset.state = view.state;
    node.dataset.mode = this._mode;
    node.dataset.severity = view.severity;
    node.dataset.hold = view.hold ?? '';
    node.dataset.gpuIndex = status?.gpu ? String(status.gpu.index) : '';
    node.title = description.title;
    node.setAttribute('aria-label', description.ariaLabel);

    // Strings become text nodes: nothing from the server is parsed as HTML.
    // One inline span, so the separators keep their spaces in the flex item.
    VirtualDOM.render(
      h.span(
        { className: 'jp-gpufrac-StatusItem-label' },
        label.gpu
          ? h.span({ className: 'jp-gpufrac-StatusItem-gpu' }, label.gpu)
          : null,
        label.gpu && label.figures ? ': ' : null,
        label.figures
          ? h.span(
              {
                className: 'jp-gpufrac-StatusItem-figures',
                dataset: { verified: String(view.verified) }
              },
              label.figures
            )
          : null,
        label.word && (label.gpu || label.figures) ? ' · ' : null,
        label.word
          ? h.span(
              {
                className: 'jp-gpufrac-StatusItem-state',
                dataset: {
                  state: view.state,
                  severity: view.severity,
                  ...(view.secondsLeft !== null
                    ? { 'seconds-left': String(view.secondsLeft) }
                    : {})
                }
              },
              label.word
            )
          : null
      ),
      node
    );
  }

  private _mode: StatusItemMode = 'compact';
}
