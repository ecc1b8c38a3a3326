/**
 * The details panel (main area): the current kernel's lease, the node's GPUs
 * with this user's leases on them, and the kernel's recent history.
 */
import { Message } from '@lumino/messaging';
import { Poll } from '@lumino/polling';
import { Widget } from '@lumino/widgets';

import { ApiError, fetchNode, IGpuFracEvent, ILease, INodeInfo } from './api';
import { h, replaceChildren } from './dom';
import {
  describeEvent,
  formatBytes,
  formatTime,
  gpuLabel,
  restoredSummary,
  stateHelp,
  stateLabel
} from './format';
import { GpuFracModel } from './model';
import { usageBar } from './usageBar';

/** Finds the notebook path of a kernel id, for naming leases. */
export type KernelNamer = (kernelId: string) => string | null;

let nextId = 0;

export class GpuFracPanel extends Widget {
  constructor(
    private readonly _model: GpuFracModel,
    private readonly _kernelName: KernelNamer
  ) {
    super();
    this.id = 'jp-gpufrac-panel';
    this.addClass('jp-gpufrac-Panel');
    this.title.label = 'GPU lease';
    this.title.caption =
      'GPU lease of the current kernel and GPUs of this node';
    this.title.closable = true;
    this.node.tabIndex = -1;
    this.node.setAttribute('role', 'region');
    this.node.setAttribute('aria-label', 'GPU lease details');
    this._prefix = `jp-gpufrac-panel-${nextId++}`;
    this._nodePoll = new Poll<void, ApiError, 'fetch'>({
      factory: () => this._fetchNode(),
      frequency: { interval: 5000, backoff: true, max: 60 * 1000 },
      name: 'jupyter-gpufrac:node',
      standby: () => !this.isVisible || 'when-hidden'
    });
    const refresh = h(
      'button',
      {
        class: 'jp-gpufrac-Panel-refresh jp-mod-styled',
        type: 'button',
        'aria-label': 'Refresh GPU information'
      },
      'Refresh'
    );
    refresh.addEventListener('click', () => void this.refresh());
    this.node.appendChild(
      h('div', { class: 'jp-gpufrac-Panel-header' }, this._title, refresh)
    );
    this.node.appendChild(this._body);
    _model.changed.connect(this._render, this);
    this._render();
  }

  dispose(): void {
    if (this.isDisposed) {
      return;
    }
    this._model.changed.disconnect(this._render, this);
    this._nodePoll.dispose();
    super.dispose();
  }

  /** Fetch the node's GPUs and the kernel's status again. */
  async refresh(): Promise<void> {
    await Promise.all([this._nodePoll.refresh(), this._model.refresh()]);
  }

  protected onAfterShow(msg: Message): void {
    super.onAfterShow(msg);
    void this._nodePoll.refresh();
  }

  protected onActivateRequest(msg: Message): void {
    super.onActivateRequest(msg);
    this.node.focus();
  }

  private async _fetchNode(): Promise<void> {
    try {
      this._node = await fetchNode(this._model.serverSettings);
      this._nodeError = null;
    } catch (err) {
      this._nodeError = err instanceof ApiError ? err.message : String(err);
      this._render();
      throw err;
    }
    this._render();
  }

  private _render(): void {
    if (this.isDisposed) {
      return;
    }
    this._title.textContent = this._model.path
      ? `GPU lease — ${this._model.path.split('/').pop()}`
      : 'GPU lease';
    // Only the body is rebuilt: the header's button keeps keyboard focus.
    replaceChildren(
      this._body,
      this._kernelSection(),
      this._nodeSection(),
      this._historySection()
    );
  }

  private _section(key: string, heading: string, ...body: Node[]): HTMLElement {
    const headingId = `${this._prefix}-${key}`;
    return h(
      'section',
      { class: `jp-gpufrac-Panel-section`, 'aria-labelledby': headingId },
      h('h3', { id: headingId }, heading),
      ...body
    );
  }

  private _kernelSection(): HTMLElement {
    const model = this._model;
    const status = model.status;
    const state = model.state;
    if (model.kernelId === null) {
      return this._section(
        'kernel',
        'This kernel',
        h('p', {}, 'Open a notebook to see its GPU lease.')
      );
    }
    const stateLine = h(
      'p',
      { class: 'jp-gpufrac-Panel-state' },
      h(
        'span',
        { class: 'jp-gpufrac-State', 'data-state': state },
        stateLabel(state, status?.deadline)
      ),
      ` ${stateHelp(state)}`,
      status?.reason ? ` ${status.reason}` : '',
      !status && model.error ? ` (${model.error})` : ''
    );
    if (!status) {
      return this._section('kernel', 'This kernel', stateLine);
    }
    const rows: Array<[string, Node | string]> = [];
    if (status.gpu) {
      rows.push(['GPU', gpuLabel(status.gpu)]);
      rows.push(['Device', `${status.gpu.name}, ${status.gpu.uuid}`]);
      rows.push([
        'Memory',
        h(
          'span',
          { class: 'jp-gpufrac-Panel-usage' },
          usageBar(status),
          ` ${formatBytes(status.usage)} used of ${formatBytes(status.request)} guaranteed, ${formatBytes(status.limit)} limit`
        )
      ]);
    }
    const lease = status.lease;
    if (lease) {
      rows.push(['Lease', `${lease.id} (${lease.kind}, ${lease.state})`]);
      if (lease.request_spec || lease.limit_spec) {
        rows.push([
          'Asked for',
          `request ${lease.request_spec ?? '–'}, limit ${lease.limit_spec ?? lease.request_spec ?? '–'}`
        ]);
      }
      const placement = this._placement(lease);
      if (placement) {
        rows.push(['Placement', placement]);
      }
    }
    const restore = status.restore;
    if (restore) {
      // Names, with the reason each could not come back: what the user must redo.
      const lost = restore.lost.map(name => {
        const why = restore.lost_reasons?.[name];
        return why ? `${name} (${why})` : name;
      });
      const parts = [
        restore.error
          ? `nothing restored: ${restore.error}`
          : `${restore.restored.length} of ${restore.restored.length + restore.lost.length} variables back`
      ];
      if (lost.length) {
        parts.push(`lost: ${lost.join(', ')}`);
      }
      if (restore.interrupted_cell) {
        parts.push(`cell ${restore.interrupted_cell} was cut off: re-run it`);
      }
      rows.push(['Last restore', `${parts.join('; ')}.`]);
    }
    rows.push(['Kernel', status.kernel_id]);
    const dl = h('dl', { class: 'jp-gpufrac-Panel-facts' });
    for (const [term, value] of rows) {
      dl.appendChild(h('dt', {}, term));
      dl.appendChild(h('dd', {}, value));
    }
    return this._section('kernel', 'This kernel', stateLine, dl);
  }

  /** Explains logical vs physical placement in the words of DESIGN.md. */
  private _placement(lease: ILease): string | null {
    const index = (uuid: string | null | undefined): string => {
      const gpu = this._node?.gpus.find(g => g.uuid === uuid);
      return gpu ? `GPU ${gpu.index}` : (uuid ?? '?');
    };
    if (!lease.physical_gpu) {
      return null;
    }
    if (lease.target_gpus?.length) {
      return `on ${index(lease.physical_gpu)}, moving to ${lease.target_gpus.map(index).join(', ')}`;
    }
    if (lease.logical_gpu && lease.logical_gpu !== lease.physical_gpu) {
      return `on ${index(lease.physical_gpu)}, spread out so it can burst; it moves to ${index(lease.logical_gpu)} when a job needs the whole GPU`;
    }
    return `on ${index(lease.physical_gpu)}`;
  }

  private _nodeSection(): HTMLElement {
    const node = this._node;
    if (!node) {
      return this._section(
        'node',
        'GPUs on this node',
        h(
          'p',
          {},
          this._nodeError ? `Not available: ${this._nodeError}` : 'Loading…'
        )
      );
    }
    const intro: Node[] = [];
    if (node.simulated) {
      intro.push(
        h(
          'p',
          { class: 'jp-gpufrac-Panel-note' },
          'This node is simulated: no real GPU is used.'
        )
      );
    }
    if (node.agent && node.agent.available === false) {
      intro.push(
        h(
          'p',
          { class: 'jp-gpufrac-Panel-note' },
          `GPU agent unavailable${node.agent.error ? `: ${node.agent.error}` : ''}.`
        )
      );
    }
    const leases = new Map(node.leases.map(l => [l.id, l]));
    const table = h(
      'table',
      { class: 'jp-gpufrac-Panel-gpus' },
      h(
        'thead',
        {},
        h(
          'tr',
          {},
          h('th', { scope: 'col' }, 'GPU'),
          h('th', { scope: 'col' }, 'Memory'),
          h('th', { scope: 'col' }, 'Your leases')
        )
      )
    );
    const body = h('tbody');
    for (const gpu of node.gpus) {
      const mine = (gpu.leases ?? [])
        .map(id => leases.get(id))
        .filter((l): l is ILease => l !== undefined);
      const list = h('ul', { class: 'jp-gpufrac-Panel-leases' });
      for (const lease of mine) {
        list.appendChild(
          h(
            'li',
            {
              'data-current':
                lease.kernel_id === this._model.kernelId ? 'true' : undefined
            },
            this._leaseLine(lease)
          )
        );
      }
      body.appendChild(
        h(
          'tr',
          { 'data-gpu-index': String(gpu.index) },
          h(
            'th',
            { scope: 'row' },
            gpuLabel(gpu),
            gpu.healthy
              ? ''
              : h('span', { class: 'jp-gpufrac-Panel-unhealthy' }, ' unhealthy')
          ),
          h(
            'td',
            { class: 'jp-gpufrac-Panel-memory' },
            usageBar({
              usage: gpu.memory_used,
              request: gpu.memory_total,
              limit: gpu.memory_total
            }),
            h(
              'span',
              {},
              `${formatBytes(gpu.memory_used)} of ${formatBytes(gpu.memory_total)}`,
              gpu.utilization !== null && gpu.utilization !== undefined
                ? `, ${gpu.utilization}% busy`
                : ''
            )
          ),
          h('td', {}, mine.length ? list : 'none')
        )
      );
    }
    table.appendChild(body);
    return this._section('node', 'GPUs on this node', ...intro, table);
  }

  private _leaseLine(lease: ILease): string {
    let who: string;
    if (lease.kind === 'job') {
      who = lease.name ? `job ${ellipsis(lease.name, 40)}` : 'job';
    } else {
      const nb = lease.kernel_id ? this._kernelName(lease.kernel_id) : null;
      who =
        nb ??
        (lease.name
          ? ellipsis(lease.name, 40)
          : `kernel ${lease.kernel_id?.slice(0, 8) ?? '?'}`);
    }
    const current =
      lease.kernel_id && lease.kernel_id === this._model.kernelId
        ? ' (this kernel)'
        : '';
    return `${who}${current}: ${formatBytes(lease.usage)} of ${formatBytes(lease.request)}–${formatBytes(lease.limit)}, ${lease.state}`;
  }

  private _historySection(): HTMLElement {
    const events: IGpuFracEvent[] = [
      ...(this._model.status?.events ?? [])
    ].reverse();
    if (!events.length) {
      return this._section(
        'history',
        'Recent history',
        h('p', {}, 'Nothing happened to this kernel yet.')
      );
    }
    const list = h('ol', { class: 'jp-gpufrac-Panel-history', reversed: '' });
    for (const event of events.slice(0, 20)) {
      let text = describeEvent(event);
      if (event.event === 'restored' && !event.message) {
        text = `Restored: ${restoredSummary(event)}.`;
      }
      const when = event.time
        ? new Date(event.time * 1000).toISOString()
        : undefined;
      list.appendChild(
        h(
          'li',
          { 'data-event': event.event },
          h('time', { datetime: when }, formatTime(event.time)),
          ' ',
          text
        )
      );
    }
    return this._section('history', 'Recent history', list);
  }

  private _node: INodeInfo | null = null;
  private _nodeError: string | null = null;
  private _nodePoll: Poll<void, ApiError, 'fetch'>;
  private readonly _prefix: string;
  private readonly _title = h('h2');
  private readonly _body = h('div', { class: 'jp-gpufrac-Panel-body' });
}

function ellipsis(text: string, max: number): string {
  return text.length > max ? `${text.slice(0, max - 1)}…` : text;
}
