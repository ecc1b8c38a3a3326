/**
 * The status bar item: "GPU 1 · 16GiB · simulated [▮▮▯|▯] bursting".
 * It is a focusable button; Enter, Space or a click open the details panel.
 */
import { Widget } from '@lumino/widgets';

import { h, replaceChildren } from './dom';
import { formatBytes, gpuLabel } from './format';
import { GpuFracModel } from './model';
import { usageBar } from './usageBar';

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
    const state = view.state;
    const gpu = status?.gpu ?? null;
    const node = this.node;
    node.dataset.state = state;
    node.dataset.severity = view.severity;
    node.dataset.gpuIndex = gpu ? String(gpu.index) : '';

    // Without a GPU the state word says it all ("no GPU", "unavailable").
    const label = gpu ? gpuLabel(gpu) : state === 'no-gpu' ? '' : 'GPU';
    const figures = {
      usage: status?.usage,
      request: status?.request,
      limit: status?.limit
    };
    // Without the agent the figures are the last known ones, not a guarantee.
    const numbers = gpu
      ? view.verified
        ? `${formatBytes(figures.usage)} used, ${formatBytes(figures.request)} guaranteed, ${formatBytes(figures.limit)} limit`
        : `last known: ${formatBytes(figures.usage)} used, ${formatBytes(figures.request)} requested, ${formatBytes(figures.limit)} limit`
      : '';
    const reason = view.reason ? ` ${view.reason}` : '';
    const summary = [label, numbers, view.label].filter(Boolean).join(', ');
    node.title = `${summary}. ${view.help}${reason}\nClick for details.`;
    node.setAttribute(
      'aria-label',
      `GPU lease: ${summary}.${reason} Press Enter for details.`
    );

    replaceChildren(
      node,
      label ? h('span', { class: 'jp-gpufrac-StatusItem-gpu' }, label) : null,
      gpu ? usageBar(figures, 'jp-gpufrac-StatusItem-bar') : null,
      h(
        'span',
        {
          class: 'jp-gpufrac-StatusItem-state',
          'data-state': state,
          'data-severity': view.severity,
          'data-seconds-left':
            view.secondsLeft !== null ? String(view.secondsLeft) : undefined
        },
        view.label
      )
    );
  }
}
