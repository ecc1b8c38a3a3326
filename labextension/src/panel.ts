/**
 * The details panel (main area): the current kernel's lease, the node's GPUs
 * with this user's leases on them, and the kernel's recent history.
 */
import { IDisposable } from '@lumino/disposable';
import { Message } from '@lumino/messaging';
import { h, VirtualDOM, VirtualElement } from '@lumino/virtualdom';
import { Widget } from '@lumino/widgets';

import { IGpuFracEvent, IKernelStatus, ILease, INodeGpu } from './api';
import { describeEvent, formatTime, gpuLabel } from './format';
import { historyEntries } from './history';
import {
  askedFor,
  computeLine,
  freezingLine,
  leaseStateWords,
  recoveryPointLine,
  stateKept,
  unprotectedLine,
  writingLine
} from './lease';
import { formatBytes, shareRange } from './memory';
import { GpuFracModel } from './model';
import { restoreAdvice, restoreFactsOf, restoreSummary } from './restore';
import { configProblemsHeading } from './settings';
import { stateView } from './stateView';
import { memoryLine } from './statusText';
import { usageBar } from './usageBar';
import { cellLabel, codePieces, notebookName } from './words';

/** A server's sentence with its commands shown as code, never as literal backticks. */
function prose(text: string): h.Child[] {
  return codePieces(text).map(piece =>
    piece.code ? h.code(piece.text) : piece.text
  );
}

/** A lease's state as the node table shows it. */
interface ILeaseView {
  state: string;
  words: string;
  /** Its kernel's account, where the server keeps one. */
  status?: IKernelStatus;
}

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
    const trans = _model.trans;
    this.title.label = trans.__('GPU lease');
    this.title.caption = trans.__(
      'GPU lease of the current kernel and GPUs of this node'
    );
    this.title.closable = true;
    this.node.tabIndex = -1;
    this.node.setAttribute('role', 'region');
    this.node.setAttribute('aria-label', trans.__('GPU lease details'));
    this._prefix = `jp-gpufrac-panel-${nextId++}`;
    // The model polls the node (every 5 s while the page is visible).
    this._nodeWatch = _model.watchNode();
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
    const trans = this._model.trans;
    const status = this._model.status;
    const path = status?.notebook || this._model.path;
    // Ids are for looking things up, not for reading: the heading's tooltip.
    const ids = [
      path,
      status?.lease?.id && trans.__('lease %1', status.lease.id),
      status?.kernel_id && trans.__('kernel %1', status.kernel_id)
    ]
      .filter(Boolean)
      .join('\n');
    // VirtualDOM.render diffs against the last rendering: the header's button
    // stays the same element, so it keeps the keyboard focus.
    VirtualDOM.render(
      [
        h.div(
          { className: 'jp-gpufrac-Panel-header' },
          h.h2(
            ids ? { title: ids } : {},
            path
              ? trans.__('GPU lease — %1', notebookName(path))
              : trans.__('GPU lease')
          ),
          h.button(
            {
              className: 'jp-gpufrac-Panel-refresh jp-mod-styled',
              type: 'button',
              'aria-label': trans.__('Refresh GPU information'),
              onclick: this._onRefresh
            },
            trans.__('Refresh')
          )
        ),
        h.div(
          { className: 'jp-gpufrac-Panel-body' },
          this._configSection(),
          this._kernelSection(),
          this._nodeSection(),
          this._historySection()
        )
      ],
      this.node
    );
  }

  private _onRefresh = (): void => {
    void this.refresh();
  };

  private _section(
    key: string,
    heading: string,
    ...body: h.Child[]
  ): VirtualElement {
    const headingId = `${this._prefix}-${key}`;
    return h.section(
      { className: 'jp-gpufrac-Panel-section', 'aria-labelledby': headingId },
      h.h3({ id: headingId }, heading),
      ...body
    );
  }

  /**
   * The server's c.GpuFrac settings problems, on top: until they are fixed no
   * kernel gets a lease, which explains everything below.
   */
  private _configSection(): VirtualElement | null {
    const problems = this._model.configProblems;
    if (!problems.length) {
      return null;
    }
    return h.div(
      { className: 'jp-gpufrac-Panel-config', role: 'alert' },
      h.p(configProblemsHeading(problems.length, this._model.trans)),
      h.ul(problems.map(problem => h.li(problem)))
    );
  }

  private _kernelSection(): VirtualElement {
    const model = this._model;
    const trans = model.trans;
    const status = model.status;
    const view = model.view();
    const state = view.state;
    if (model.kernelId === null) {
      return this._section(
        'kernel',
        trans.__('This kernel'),
        h.p(trans.__('Open a notebook to see its GPU lease.'))
      );
    }
    const stateLine = h.p(
      { className: 'jp-gpufrac-Panel-state' },
      h.span(
        {
          className: 'jp-gpufrac-State',
          dataset: {
            state,
            severity: view.severity,
            ...(view.secondsLeft !== null
              ? { 'seconds-left': String(view.secondsLeft) }
              : {})
          }
        },
        view.label
      ),
      ` ${view.help}`
    );
    // The server's sentence in full: the notifications only have room for its start.
    const reason = view.reason
      ? h.p({ className: 'jp-gpufrac-Panel-reason' }, ...prose(view.reason))
      : null;
    if (!status) {
      const error = model.error
        ? h.p({ className: 'jp-gpufrac-Panel-note' }, `(${model.error})`)
        : null;
      return this._section(
        'kernel',
        trans.__('This kernel'),
        stateLine,
        reason,
        error
      );
    }
    const rows: Array<[string, h.Child]> = [];
    const restore = status.restore;
    // The restore is news until the user runs something (the server's state
    // says so); after that it is history, and a row saying "Restored state:
    // as it was after cell [1]" at cell [20] would be stale.
    if (restore && (state === 'restored' || state === 'restore-incomplete')) {
      // First: what the user must redo. Each lost name with why, and the cell cut off.
      const facts = restoreFactsOf(restore);
      const advice = restoreAdvice(facts, trans);
      if (advice) {
        rows.push([trans.__('What to do'), h.strong(advice)]);
      }
      rows.push([
        trans.__('Last restore'),
        h.span(
          {
            className: 'jp-gpufrac-Panel-restore',
            dataset: { ok: restore.ok ? 'true' : 'false' }
          },
          `${restoreSummary(facts, { reasons: true, advice: false }, trans)}.`,
          restore.time ? ` (${formatTime(restore.time)})` : null
        )
      ]);
      if (restore.interrupted_cell) {
        rows.push([
          trans.__('Cut-off cell'),
          cellLabel(restore.interrupted_cell)
        ]);
      }
      if (
        restore.checkpoint_cell !== null &&
        restore.checkpoint_cell !== undefined
      ) {
        rows.push([
          trans.__('Restored state'),
          trans.__('as it was after cell [%1]', restore.checkpoint_cell)
        ]);
      }
    }
    if (status.gpu) {
      rows.push([trans.__('GPU'), gpuLabel(status.gpu, trans)]);
      rows.push([trans.__('Device'), `${status.gpu.name}, ${status.gpu.uuid}`]);
      rows.push([
        trans.__('Memory'),
        h.span(
          { className: 'jp-gpufrac-Panel-usage' },
          usageBar(status),
          ` ${memoryLine(status, view.verified, trans)}`
        )
      ]);
    }
    // What keeps its variables while it has no GPU: frozen, or the checkpoint.
    const kept = stateKept(status, trans);
    if (kept) {
      rows.push([
        trans.__('Kept by'),
        h.span(
          {
            className: 'jp-gpufrac-Panel-kept',
            dataset: {
              protection: status.protection ?? '',
              fallback: status.fallback ? 'true' : 'false'
            }
          },
          kept
        )
      ]);
    }
    // What a restart restores now, its age as of this render; and what it lacks.
    const point = recoveryPointLine(
      status.checkpoint,
      Date.now() / 1000,
      trans
    );
    if (point) {
      rows.push([trans.__('Restart restores'), point]);
    }
    const writing = writingLine(status.checkpoint, trans);
    if (writing) {
      rows.push([trans.__('Writing'), writing]);
    }
    if (status.checkpoint?.error) {
      rows.push([trans.__('Last write failed'), status.checkpoint.error]);
    }
    const unprotected = unprotectedLine(status.checkpoint, trans);
    if (unprotected) {
      rows.push([
        trans.__('Not protected'),
        h.span({ className: 'jp-gpufrac-Panel-unprotected' }, unprotected)
      ]);
    }
    const lease = status.lease;
    // Where the share came from answers "why this much?"; a lease that
    // predates the server process has specs but no sources.
    const asked = askedFor(lease, status.share_source, trans);
    if (asked) {
      rows.push([
        trans.__('Asked for'),
        h.span({ className: 'jp-gpufrac-Panel-asked' }, asked)
      ]);
    }
    if (lease) {
      const placement = this._placement(lease);
      if (placement) {
        rows.push([trans.__('Placement'), placement]);
      }
      const compute = computeLine(lease, !!this._model.node?.mps, trans);
      if (compute) {
        rows.push([trans.__('Compute'), compute]);
      }
    }
    const facts = h.dl(
      { className: 'jp-gpufrac-Panel-facts' },
      rows.map(([term, value]) => [h.dt(term), h.dd(value)]).flat()
    );
    return this._section(
      'kernel',
      trans.__('This kernel'),
      stateLine,
      reason,
      facts
    );
  }

  /** Explains logical vs physical placement in the words of DESIGN.md. */
  private _placement(lease: ILease): string | null {
    const trans = this._model.trans;
    const index = (uuid: string | null | undefined): string => {
      const gpu = this._model.node?.gpus.find(g => g.uuid === uuid);
      return gpu ? trans.__('GPU %1', gpu.index) : (uuid ?? '?');
    };
    if (!lease.physical_gpu) {
      return null;
    }
    const on = index(lease.physical_gpu);
    if (lease.target_gpus?.length) {
      return trans.__(
        'on %1, moving to %2',
        on,
        lease.target_gpus.map(index).join(', ')
      );
    }
    if (lease.logical_gpu && lease.logical_gpu !== lease.physical_gpu) {
      return trans.__(
        'on %1, spread out so it can burst; it moves to %2 when a job needs the whole GPU',
        on,
        index(lease.logical_gpu)
      );
    }
    return trans.__('on %1', on);
  }

  /** Why nothing about the share is verified, while the agent does not answer. */
  private _agentNote(): VirtualElement | null {
    const agent = this._model.agent;
    const node = this._model.node;
    if (!agent.down && node?.agent?.available !== false) {
      return null;
    }
    const trans = this._model.trans;
    const why = (agent.reason ?? node?.agent?.error ?? '').trim();
    const text = why
      ? trans.__('GPU agent unreachable: %1', why)
      : trans.__('GPU agent unreachable.');
    return h.p(
      { className: 'jp-gpufrac-Panel-agent' },
      node
        ? trans.__('%1 The figures below are the last ones seen.', text)
        : text
    );
  }

  private _nodeSection(): VirtualElement {
    const trans = this._model.trans;
    const node = this._model.node;
    if (!node) {
      return this._section(
        'node',
        trans.__('GPUs on this node'),
        this._agentNote(),
        h.p(
          this._model.nodeError
            ? trans.__('Not available: %1', this._model.nodeError)
            : trans.__('Loading…')
        )
      );
    }
    const simulated = node.simulated
      ? h.p(
          { className: 'jp-gpufrac-Panel-note' },
          trans.__('This node is simulated: no real GPU is used.')
        )
      : null;
    const freezingOff = freezingLine(node.freezing, trans);
    const freezing = freezingOff
      ? h.p(
          { className: 'jp-gpufrac-Panel-note', dataset: { freezing: 'off' } },
          freezingOff
        )
      : null;
    // Each lease where its kernel's account puts it: the GPU it runs on, or
    // the "no GPU" row while it is parked or waiting for one.
    const placed = node.leases.map(lease => {
      const view = this._leaseView(lease);
      return { lease, view, on: leaseGpu(lease, view, node.gpus) };
    });
    const list = (entries: typeof placed): VirtualElement =>
      h.ul(
        { className: 'jp-gpufrac-Panel-leases' },
        entries.map(({ lease, view, on }) =>
          h.li(
            {
              dataset: {
                state: view.state,
                ...(lease.kernel_id === this._model.kernelId
                  ? { current: 'true' }
                  : {})
              }
            },
            this._leaseLine(lease, view, on !== null)
          )
        )
      );
    const rows = node.gpus.map(gpu => {
      // A job's lease may hold several GPUs: it is in each one's row.
      const mine = placed.filter(entry =>
        entry.view.status
          ? entry.on === gpu.uuid
          : (gpu.leases ?? []).includes(entry.lease.id)
      );
      return h.tr(
        { dataset: { 'gpu-index': String(gpu.index) } },
        h.th(
          { scope: 'row' },
          gpuLabel(gpu, trans),
          gpu.healthy
            ? null
            : h.span(
                { className: 'jp-gpufrac-Panel-unhealthy' },
                ` ${trans.__('unhealthy')}`
              )
        ),
        h.td(
          { className: 'jp-gpufrac-Panel-memory' },
          usageBar({
            usage: gpu.memory_used,
            request: gpu.memory_total,
            limit: gpu.memory_total
          }),
          h.span(
            gpu.utilization !== null && gpu.utilization !== undefined
              ? trans.__(
                  '%1 of %2, %3% busy',
                  formatBytes(gpu.memory_used),
                  formatBytes(gpu.memory_total),
                  gpu.utilization
                )
              : trans.__(
                  '%1 of %2',
                  formatBytes(gpu.memory_used),
                  formatBytes(gpu.memory_total)
                )
          )
        ),
        h.td(mine.length ? list(mine) : trans.__('none'))
      );
    });
    const without = placed.filter(entry => entry.on === null);
    if (without.length) {
      rows.push(
        h.tr(
          { dataset: { gpu: 'none' } },
          h.th({ scope: 'row' }, trans.__('No GPU')),
          h.td(
            { className: 'jp-gpufrac-Panel-memory' },
            trans.__('holding no GPU memory')
          ),
          h.td(list(without))
        )
      );
    }
    const table = h.table(
      { className: 'jp-gpufrac-Panel-gpus' },
      h.thead(
        h.tr(
          h.th({ scope: 'col' }, trans.__('GPU')),
          h.th({ scope: 'col' }, trans.__('Memory')),
          h.th({ scope: 'col' }, trans.__('Your leases'))
        )
      ),
      h.tbody(rows)
    );
    return this._section(
      'node',
      trans.__('GPUs on this node'),
      simulated,
      freezing,
      this._agentNote(),
      table
    );
  }

  /**
   * How a lease reads in the table: for the kernel followed, exactly what
   * "This kernel" says (the same status); for another kernel of this server,
   * its account as of the node's answer; a job or an older server's lease, the
   * agent's own state.
   */
  private _leaseView(lease: ILease): ILeaseView {
    const model = this._model;
    const trans = model.trans;
    if (lease.kernel_id && lease.kernel_id === model.kernelId && model.status) {
      const view = model.view();
      return { state: view.state, words: view.label, status: model.status };
    }
    const account = lease.account;
    if (account) {
      const status: IKernelStatus = {
        ...account,
        kernel_id: lease.kernel_id ?? '',
        lease
      };
      const view = stateView(
        account.state,
        status,
        model.agent,
        Date.now() / 1000,
        trans
      );
      return { state: view.state, words: view.label, status };
    }
    return { state: lease.state, words: leaseStateWords(lease, trans) };
  }

  private _leaseLine(lease: ILease, view: ILeaseView, onGpu: boolean): string {
    const trans = this._model.trans;
    let who: string;
    if (lease.kind === 'job') {
      who = lease.name
        ? trans.__('job %1', ellipsis(lease.name, 40))
        : trans.__('job');
    } else {
      const nb = lease.kernel_id ? this._kernelName(lease.kernel_id) : null;
      who =
        nb ??
        (lease.name
          ? ellipsis(lease.name, 40)
          : trans.__('kernel %1', lease.kernel_id?.slice(0, 8) ?? '?'));
    }
    if (lease.kernel_id && lease.kernel_id === this._model.kernelId) {
      who = trans.__('%1 (this kernel)', who);
    }
    const figures = view.status ?? lease;
    const share = shareRange(figures.request, figures.limit);
    if (!onGpu) {
      // Parked, or waiting for a GPU: it uses none.
      return trans.__('%1: %2, %3', who, share, view.words);
    }
    return trans.__(
      '%1: %2 of %3, %4',
      who,
      formatBytes(figures.usage),
      share,
      view.words
    );
  }

  private _historySection(): VirtualElement {
    const trans = this._model.trans;
    const entries = historyEntries(this._model.status?.events ?? []).reverse();
    if (!entries.length) {
      return this._section(
        'history',
        trans.__('Recent history'),
        h.p(trans.__('Nothing happened to this kernel yet.'))
      );
    }
    const when = (event: IGpuFracEvent): VirtualElement =>
      h.time(
        event.time
          ? { datetime: new Date(event.time * 1000).toISOString() }
          : {},
        formatTime(event.time)
      );
    const items = entries.slice(0, 20).map(({ event, steps }) =>
      h.li(
        {
          dataset: {
            event: event.event,
            ...(event.event === 'restored'
              ? { ok: event.ok === true ? 'true' : 'false' }
              : {})
          }
        },
        when(event),
        ' ',
        ...prose(describeEvent(event, trans)),
        steps.length > 1
          ? h(
              'details',
              h.summary(trans._n('%1 step', '%1 steps', steps.length)),
              h.ol(
                steps.map(step =>
                  h.li(
                    { dataset: { event: step.event } },
                    when(step),
                    ' ',
                    ...prose(describeEvent(step, trans))
                  )
                )
              )
            )
          : null
      )
    );
    return this._section(
      'history',
      trans.__('Recent history'),
      // Numbered newest first; `start` as the count of entries, as the
      // browser's own count would take the folded steps' items too.
      h.ol(
        {
          className: 'jp-gpufrac-Panel-history',
          reversed: '',
          start: String(items.length)
        },
        items
      )
    );
  }

  private _nodeWatch: IDisposable;
  private readonly _prefix: string;
}

/** The UUID of the GPU in whose row a lease is, or null for the "No GPU" row. */
function leaseGpu(
  lease: ILease,
  view: ILeaseView,
  gpus: INodeGpu[]
): string | null {
  if (view.status) {
    const parked = ['parked', 'waiting-for-gpu'].includes(view.state);
    return parked ? null : (view.status.gpu?.uuid ?? null);
  }
  return gpus.find(gpu => gpu.leases?.includes(lease.id))?.uuid ?? null;
}

function ellipsis(text: string, max: number): string {
  return text.length > max ? `${text.slice(0, max - 1)}…` : text;
}
