/**
 * The details panel (main area): the current kernel's lease, the node's GPUs
 * with this user's leases on them, and the kernel's recent history.
 */
import { IDisposable } from '@lumino/disposable';
import { Message } from '@lumino/messaging';
import { Widget } from '@lumino/widgets';

import { IGpuFracEvent, ILease } from './api';
import { LEASE_STATE_WORDS } from './contract';
import { h, replaceChildren } from './dom';
import { describeEvent, formatBytes, formatTime, gpuLabel } from './format';
import { GpuFracModel } from './model';
import { usageBar } from './usageBar';
import {
  cellLabel,
  computeLine,
  notebookName,
  restoreAdvice,
  restoreFactsOf,
  restoreSummary
} from './view';

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
    // The model polls the node (every 5 s while the page is visible).
    this._nodeWatch = _model.watchNode();
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
    this._nodeWatch.dispose();
    super.dispose();
  }

  /** Fetch the node's GPUs and the kernel's status again. */
  async refresh(): Promise<void> {
    await Promise.all([this._model.refreshNode(), this._model.refresh()]);
  }

  protected onAfterShow(msg: Message): void {
    super.onAfterShow(msg);
    void this._model.refreshNode();
  }

  protected onActivateRequest(msg: Message): void {
    super.onActivateRequest(msg);
    this.node.focus();
  }

  private _render(): void {
    if (this.isDisposed) {
      return;
    }
    const path = this._model.status?.notebook || this._model.path;
    this._title.textContent = path
      ? `GPU lease — ${notebookName(path)}`
      : 'GPU lease';
    this._title.title = path;
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
    const view = model.view();
    const state = view.state;
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
        {
          class: 'jp-gpufrac-State',
          'data-state': state,
          'data-severity': view.severity,
          'data-seconds-left':
            view.secondsLeft !== null ? String(view.secondsLeft) : undefined
        },
        view.label
      ),
      ` ${view.help}`
    );
    // The server's sentence in full: the notifications only have room for its start.
    const reason = view.reason
      ? h('p', { class: 'jp-gpufrac-Panel-reason' }, view.reason)
      : null;
    const error =
      !status && model.error
        ? h('p', { class: 'jp-gpufrac-Panel-note' }, `(${model.error})`)
        : null;
    if (!status) {
      return this._section(
        'kernel',
        'This kernel',
        ...[stateLine, reason, error].filter((n): n is HTMLElement => !!n)
      );
    }
    const rows: Array<[string, Node | string]> = [];
    const restore = status.restore;
    if (restore) {
      // First: what the user must redo. Each lost name with why, and the cell cut off.
      const facts = restoreFactsOf(restore);
      const advice = restoreAdvice(facts);
      if (advice) {
        rows.push(['What to do', h('strong', {}, advice)]);
      }
      rows.push([
        'Last restore',
        h(
          'span',
          {
            class: 'jp-gpufrac-Panel-restore',
            'data-ok': restore.ok ? 'true' : 'false'
          },
          `${restoreSummary(facts, { reasons: true, advice: false })}.`,
          restore.time ? ` (${formatTime(restore.time)})` : ''
        )
      ]);
      if (restore.interrupted_cell) {
        rows.push(['Cut-off cell', cellLabel(restore.interrupted_cell)]);
      }
      if (
        restore.checkpoint_cell !== null &&
        restore.checkpoint_cell !== undefined
      ) {
        rows.push([
          'Restored state',
          `as it was after cell [${restore.checkpoint_cell}]`
        ]);
      }
    }
    if (status.gpu) {
      rows.push(['GPU', gpuLabel(status.gpu)]);
      rows.push(['Device', `${status.gpu.name}, ${status.gpu.uuid}`]);
      rows.push([
        'Memory',
        h(
          'span',
          { class: 'jp-gpufrac-Panel-usage' },
          usageBar(status),
          view.verified
            ? ` ${formatBytes(status.usage)} used of ${formatBytes(status.request)} guaranteed, ${formatBytes(status.limit)} limit`
            : ` last known: ${formatBytes(status.usage)} used, ${formatBytes(status.request)} requested, ${formatBytes(status.limit)} limit (not verified)`
        )
      ]);
    }
    const lease = status.lease;
    if (lease) {
      rows.push(['Lease', `${lease.id} (${lease.kind})`]);
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
      const compute = computeLine(lease, !!this._model.node?.mps);
      if (compute) {
        rows.push(['Compute', compute]);
      }
    }
    rows.push(['Kernel', status.kernel_id]);
    const dl = h('dl', { class: 'jp-gpufrac-Panel-facts' });
    for (const [term, value] of rows) {
      dl.appendChild(h('dt', {}, term));
      dl.appendChild(h('dd', {}, value));
    }
    return this._section(
      'kernel',
      'This kernel',
      ...[stateLine, reason, dl].filter((n): n is HTMLElement => !!n)
    );
  }

  /** Explains logical vs physical placement in the words of DESIGN.md. */
  private _placement(lease: ILease): string | null {
    const index = (uuid: string | null | undefined): string => {
      const gpu = this._model.node?.gpus.find(g => g.uuid === uuid);
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

  /** Why nothing about the share is verified, while the agent does not answer. */
  private _agentNote(): HTMLElement[] {
    const agent = this._model.agent;
    const node = this._model.node;
    if (!agent.down && node?.agent?.available !== false) {
      return [];
    }
    const why = (agent.reason ?? node?.agent?.error ?? '').trim();
    return [
      h(
        'p',
        { class: 'jp-gpufrac-Panel-agent' },
        `GPU agent unreachable${why ? `: ${why}` : '.'}${node ? ' The figures below are the last known ones.' : ''}`
      )
    ];
  }

  private _nodeSection(): HTMLElement {
    const node = this._model.node;
    if (!node) {
      return this._section(
        'node',
        'GPUs on this node',
        ...this._agentNote(),
        h(
          'p',
          {},
          this._model.nodeError
            ? `Not available: ${this._model.nodeError}`
            : 'Loading…'
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
    intro.push(...this._agentNote());
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
    return `${who}${current}: ${formatBytes(lease.usage)} of ${formatBytes(lease.request)}–${formatBytes(lease.limit)}, ${LEASE_STATE_WORDS[lease.state] ?? lease.state}`;
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
      const text = describeEvent(event);
      const when = event.time
        ? new Date(event.time * 1000).toISOString()
        : undefined;
      list.appendChild(
        h(
          'li',
          {
            'data-event': event.event,
            'data-ok':
              event.event === 'restored'
                ? event.ok === true
                  ? 'true'
                  : 'false'
                : undefined
          },
          h('time', { datetime: when }, formatTime(event.time)),
          ' ',
          text
        )
      );
    }
    return this._section('history', 'Recent history', list);
  }

  private _nodeWatch: IDisposable;
  private readonly _prefix: string;
  private readonly _title = h('h2');
  private readonly _body = h('div', { class: 'jp-gpufrac-Panel-body' });
}

function ellipsis(text: string, max: number): string {
  return text.length > max ? `${text.slice(0, max - 1)}…` : text;
}
